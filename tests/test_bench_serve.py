"""`vattn bench serve`: the ShareGPT file `vllm bench serve` reads, and a short run of vattn's server under
`vllm bench serve` (the peer environment's) beside the engine in process."""
import json
import subprocess
import sys

import pytest

from vattn import sharegpt
from vattn.bench import peers, serve


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vattn.models import model_dir

    return AutoTokenizer.from_pretrained(str(model_dir("smollm2")))


def test_the_dataset_reads_back_as_sampled_in_disjoint_chunks(tokenizer):
    chunks = serve.dataset(tokenizer, 6, 16, 3)
    assert [len(c) for c in chunks] == [6, 6, 6]
    assert len({e["conversations"][0]["value"] for c in chunks for e in c}) == 18  # no prompt in two rounds
    sampled = sharegpt.sample(tokenizer, 18)
    reqs = [r for c in chunks for r in serve.requests(tokenizer, c)]
    # the templated prompt, written as text, is read back as the very token ids the engine is given
    assert [r["prompt"] for r in reqs] == [sharegpt.chat_prompt(tokenizer, s.prompt) for s in sampled]
    for r, s in zip(reqs, sampled):
        assert 1 <= r["max_tokens"] <= 16
        if s.output_len <= 16:
            assert r["max_tokens"] == s.output_len  # a short reply is kept whole
    assert any(s.output_len > 16 for s in sampled)


def test_a_short_run_measures_the_server_against_the_engine(tmp_path):
    assert peers.vllm_python() is not None, peers.HOW
    path = tmp_path / "serve.json"
    out = subprocess.run([sys.executable, "-m", "vattn", "bench", "serve", "--systems", "vattn", "--quick",
                          "--log-dir", str(tmp_path / "logs"), "--json", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "through the server: 16 ShareGPT requests a round" in out.stdout
    said = out.stdout.splitlines()  # the engine in process serves a saturated round's requests in its turn
    assert said.index("vattn in process: round 1/1") == said.index("vattn: rate inf, round 1/1") + 1
    result = json.loads(path.read_text())
    rows = {r["load"]: r for r in result["rows"]}
    assert list(rows) == ["saturated", "busy", "calm"] and {r["system"] for r in rows.values()} == {"vattn"}
    assert rows["saturated"]["request_rate"] == "inf"
    saturated = rows["saturated"]["figures"]["request_throughput"]
    assert rows["busy"]["request_rate"] == round(serve.BUSY * saturated, 3)
    assert rows["calm"]["request_rate"] == round(serve.CALM * saturated, 3)
    for r in rows.values():
        f = r["figures"]
        assert f["completed"] == 16 and f["failed"] == 0 and len(r["rounds"]) == 1
        assert f["output_throughput"] > 0 and 0 < f["median_ttft_ms"] <= f["p99_ttft_ms"]
        assert f["median_tpot_ms"] > 0 and f["median_e2el_ms"] > f["median_ttft_ms"]
    memory = result["memory"]["vattn"]
    assert 100 << 20 < memory["peak_pss_bytes"] <= memory["peak_rss_bytes"]
    assert result["in_process"]["output_tok_per_s"] > 0 and len(result["in_process"]["rounds"]) == 1
    (verdict,) = result["verdicts"]  # without vLLM, only the server against the engine in process
    assert verdict["value"] == rows["saturated"]["figures"]["output_throughput"] / result["in_process"][
        "output_tok_per_s"]
    assert result["cpu"] and result["commit"]
    # every request of every round went to the server as vllm bench serve read it from the file
    files = sorted((tmp_path / "logs").glob("sharegpt_*.json"))
    assert len(files) == 4 and all(len(json.loads(f.read_text())) == 16 for f in files)


def test_a_run_of_vllm_alone_reports_only_its_own_target(capsys):
    """`--systems vllm`: no engine in process, no vattn row, so no ratio; vLLM's calm TTFT is still judged."""
    figures = {"output_throughput": 100.0, "request_throughput": 1.0}
    figures |= {f"{s}_{m}_ms": 1.0 for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")}
    result = {"rows": [{"system": "vllm", "load": load, "request_rate": "inf", "figures": figures}
                       for load in serve.LOADS],
              "memory": {"vllm": {"peak_pss_bytes": 1 << 30, "peak_rss_bytes": 1 << 30}}, "in_process": None,
              "num_prompts": 2, "model": "smollm2", "dtype": "float32", "max_tokens": 2, "rounds_per_figure": 1,
              "cpu": "a CPU"}
    result["verdicts"] = serve.verdicts(result)
    assert [v["target"] for v in result["verdicts"]] == ["vLLM's median TTFT in ms, calm"]
    serve._print(result)
    assert "in process" not in capsys.readouterr().out


def test_failed_rounds_say_why_and_the_load_generator_runs_the_next(tokenizer, tmp_path):
    """The load generator's one process outlives a failed round: against a port nobody listens on, no request
    is answered; with its dataset file missing, `vllm bench serve` itself fails."""
    from types import SimpleNamespace

    from vattn.bench.load_generator import LoadGenerator
    from vattn.models import model_dir

    assert peers.vllm_python() is not None, peers.HOW
    chunks = serve.dataset(tokenizer, 2, 4, 1)
    path = tmp_path / "sharegpt_0.json"
    path.write_text(json.dumps(chunks[0]))
    expected = [[r["max_tokens"] for r in serve.requests(tokenizer, chunks[0])]] * 2
    nobody = SimpleNamespace(system="nobody", url=f"http://127.0.0.1:{serve._free_port()}")
    gen = LoadGenerator([path, tmp_path / "missing.json"], expected, "smollm2", str(model_dir("smollm2")), tmp_path,
                        tmp_path / "gen.log")
    try:
        with pytest.raises(RuntimeError, match=r"nobody: 0 of 2 requests answered in full at rate inf; errors: "
                                               r"\[.*Cannot connect to host"):
            gen.round(nobody, 0, float("inf"))
        with pytest.raises(RuntimeError, match=r"vllm bench serve failed: .*missing.json.*; its log: .*gen.log"):
            gen.round(nobody, 1, float("inf"))
        with pytest.raises(RuntimeError, match="0 of 2 requests answered"):  # the process still takes rounds
            gen.round(nobody, 0, float("inf"))
    finally:
        gen.close()
    assert gen._proc.returncode == 0 and "== nobody, chunk 1" in (tmp_path / "gen.log").read_text()
