"""`vattn bench models`: the staggered workload, and a short run of one shared pool against static thirds."""
import json
import subprocess
import sys

import pytest

from vattn import sharegpt
from vattn.bench import models


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vattn.models import model_dir

    return AutoTokenizer.from_pretrained(str(model_dir("smollm2")))


def test_each_model_s_traffic_peaks_in_turn_on_requests_of_its_own(tokenizer):
    reqs = models.workload(tokenizer, 60, 10.0, 32)
    assert list(reqs) == list(models.MODELS) and all(len(r) == 60 for r in reqs.values())
    sampled = sharegpt.sample(tokenizer, 180)  # each model its own third of the requests
    assert [r["prompt"] for rs in reqs.values() for r in rs] == [sharegpt.chat_prompt(tokenizer, s.prompt)
                                                                   for s in sampled]
    for k, rs in enumerate(reqs.values()):
        arrivals = [r["arrival"] for r in rs]
        assert arrivals == sorted(arrivals) and all(k * 10 <= t <= (k + 2) * 10 for t in arrivals)
        near_peak = sum(abs(t - (k + 1) * 10) < 5 for t in arrivals)
        assert near_peak > len(arrivals) / 2  # a triangle: 3/4 of its mass lies within half its half-width
        assert all(1 <= r["max_tokens"] <= 32 for r in rs)


def test_budgets_must_split_into_whole_chunks():
    with pytest.raises(ValueError, match="multiple of 96MiB"):
        models.run(None, budgets=[100 << 20])


def test_each_figure_is_its_median_over_the_rounds():
    def run(system, k, p99):
        figures = {"requests": 3, "completed": 3, "errors": [], "p99_ttft_ms": p99, "median_ttft_ms": p99 / 2}
        return {"system": system, "budget": 96 << 20, "round": k, "overall": figures,
                "per_model": {m: figures for m in models.MODELS}, "preemptions": {m: k for m in models.MODELS},
                "peak_pss_bytes": 10 * p99, "kv_over_time": [(0.5, {m: (32 << 20, 0) for m in models.MODELS})]}

    runs = [run("shared", 0, 100.0), run("static", 0, 900.0), run("shared", 1, 300.0), run("static", 1, 150.0),
            run("shared", 2, 200.0), run("static", 2, 500.0)]
    result = {"runs": runs, "medians": models.medians(runs), "budgets": [96 << 20]}
    shared, static = result["medians"]
    assert (shared["system"], static["system"]) == ("shared", "static")
    assert shared["overall"]["p99_ttft_ms"] == 200.0 and static["overall"]["p99_ttft_ms"] == 500.0
    assert shared["per_model"]["m1"]["median_ttft_ms"] == 100.0 and shared["preemptions"]["m0"] == 1
    assert shared["peak_pss_bytes"] == 2000.0 and static["p99_ttft_ms_rounds"] == [900.0, 150.0, 500.0]
    verdicts = models.verdicts(result)
    assert [v["value"] for v in verdicts if v["target"].startswith("p99 TTFT")] == [2.5]
    assert sum("every request completed" in v["target"] for v in verdicts) == 6  # every round's


def test_a_short_run_measures_the_shared_pool_against_static_thirds(tmp_path):
    path = tmp_path / "models.json"
    out = subprocess.run([sys.executable, "-m", "vattn", "bench", "models", "--systems", "shared", "static",
                          "--budgets", "288MiB", "--num-requests", "6", "--spacing", "2", "--max-tokens", "8",
                          "--rounds", "1", "--log-dir", str(tmp_path / "logs"), "--json", str(path),
                          "--plot", str(tmp_path / "plots")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "three models, staggered peaks: 6 ShareGPT requests each" in out.stdout
    result = json.loads(path.read_text())
    assert [(r["system"], r["budget"]) for r in result["runs"]] == [("shared", 288 << 20), ("static", 288 << 20)]
    assert [(r["system"], r["overall"]) for r in result["medians"]] == [(r["system"], r["overall"])
                                                                        for r in result["runs"]]  # one round
    for r in result["runs"]:
        assert r["overall"]["completed"] == r["overall"]["requests"] == 18, r["overall"]["errors"]
        assert all(f["completed"] == 6 for f in r["per_model"].values())
        assert 0 < r["overall"]["median_ttft_ms"] <= r["overall"]["p99_ttft_ms"]
        assert r["overall"]["output_tok_per_s"] > 0 and r["peak_pss_bytes"] > 100 << 20
        held = [sum(h for h, _ in s.values()) for _, s in r["kv_over_time"]]
        assert held and max(held) <= 288 << 20 and max(held) > 0
    static = result["runs"][1]
    assert all(h <= 96 << 20 for _, s in static["kv_over_time"] for h, _ in s.values())  # each model its third
    targets = {v["target"] for v in result["verdicts"]}
    assert "p99 TTFT, static over shared, at the tightest budget (288MiB)" in targets
    assert sum("every request completed" in t for t in targets) == 2
    assert (tmp_path / "plots" / "models_288MiB.png").stat().st_size > 0
