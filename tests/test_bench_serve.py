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
