"""The end-to-end benchmark's rules: every system's KV memory within one budget, arrivals as
`vllm bench serve` draws them, and peak memory as PSS, each page counted once (the systems
themselves run in tests/test_cli.py)."""
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vattn.bench import e2e, pss
from vattn.bench.report import median_figures
from vattn.bench.shapes import SMOLLM2_135M
from vattn.config import CacheConfig

# SmolLM2-135M's geometry in float32, the engine's host layout: 46,080 bytes a token
CACHE = CacheConfig(**SMOLLM2_135M.cache_fields(), dtype=torch.float32, max_num_seqs=32, max_seq_len=2048,
                    page_size=8 << 10, layout="per_head")
BUDGET = 1 << 30


def test_every_system_gets_the_same_kv_budget():
    token = CACHE.kv_bytes_per_token
    assert e2e.settings("vattn", BUDGET, CACHE, 2048) == [{"memory_budget": BUDGET}]
    assert e2e.settings("vattn_compiled", BUDGET, CACHE, 2048) == [{"memory_budget": BUDGET, "compile": True}]
    assert e2e.settings("paged_32", BUDGET, CACHE, 2048) == [
        {"memory_budget": BUDGET, "kv_cache": "paged", "block_size": 32}]
    (vllm,) = e2e.settings("vllm_cpu", BUDGET, CACHE, 2048)
    assert vllm == {"kv_budget_bytes": BUDGET, "max_model_len": 2048}  # the model and its dtype: every worker's
    (cb,) = e2e.settings("hf_continuous_batching", BUDGET, CACHE, 2048)
    block = cb["block_size"] * token
    assert cb["num_blocks"] * block <= BUDGET < (cb["num_blocks"] + 1) * block
    static = e2e.settings("hf_static", BUDGET, CACHE, 2048)  # 1 GiB holds 11 rows at 2,048 tokens
    assert static == [{"batch_size": 8}]
    assert [s["batch_size"] for s in e2e.settings("hf_static", 32 * 2048 * token, CACHE, 2048)] == [8, 16, 32]


def test_a_budget_too_small_and_an_unknown_system_are_refused():
    with pytest.raises(ValueError, match="holds no static batch of 8 rows"):
        e2e.settings("hf_static", 7 * 2048 * CACHE.kv_bytes_per_token, CACHE, 2048)
    with pytest.raises(ValueError, match="unknown system 'tgi'"):
        e2e.settings("tgi", BUDGET, CACHE, 2048)


def test_arrivals():
    assert e2e.arrivals(4, float("inf")) == [0.0] * 4
    due = e2e.arrivals(4000, 2.0)
    gaps = [b - a for a, b in zip(due, due[1:])]
    assert due[0] == 0 and all(g > 0 for g in gaps) and due == e2e.arrivals(4000, 2.0)
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # Poisson: exponential gaps
    bursty = e2e.arrivals(4000, 2.0, burstiness=0.25)
    bursty = [b - a for a, b in zip(bursty, bursty[1:])]
    assert statistics.fmean(bursty) == pytest.approx(0.5, rel=0.1) and statistics.stdev(bursty) > 0.8


def test_median_figures_take_each_figure_on_its_own():
    rounds = [{"output_tok_per_s": t, "ttft_ms": {"mean": m, "median": m, "p99": p}, "page_size": 8192}
              for t, m, p in ((10.0, 5.0, 9.0), (30.0, 1.0, 7.0), (20.0, 3.0, 8.0))]
    assert median_figures(rounds) == {"output_tok_per_s": 20.0, "ttft_ms": {"mean": 3.0, "median": 3.0, "p99": 8.0},
                                      "page_size": 8192}
    assert median_figures(rounds[:2])["page_size"] == 8192  # a setting stays an int, even over two rounds


def test_long_workload_takes_whole_conversations_of_the_stated_lengths():
    from transformers import AutoTokenizer

    from vattn.models import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    reqs = e2e.requests(tokenizer, "long", num_prompts=3, max_tokens=256)
    assert len(reqs) == 3 and all(r["max_tokens"] == 256 for r in reqs)
    assert all(1000 <= len(r["prompt"]) <= 1792 for r in reqs)
    for r in reqs:  # through the chat template, ending ready for the assistant's reply
        text = tokenizer.decode(r["prompt"])
        assert text.count("<|im_start|>user") >= 1 and text.rstrip().endswith("<|im_start|>assistant")


def test_workload_flops_count_each_token_once():
    from transformers import LlamaConfig

    from vattn.bench import flops

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152)
    layers, head = flops.token_flops(smollm2)
    assert (layers, head) == (212_336_640, 56_623_104)  # 7.08 MFLOP a layer; the LM head 576 × 49,152 × 2
    # 10 prompt tokens, 3 answer tokens: 12 tokens fed, contexts 1..12; the LM head thrice
    attend = 4 * 30 * 9 * 64
    assert flops.workload_flops(smollm2, [{"prompt": [1] * 10, "max_tokens": 3}]) == \
        12 * layers + attend * 78 + 3 * head


# A parent that writes every page of SIZE bytes of anonymous memory and forks a child: the child
# maps the same pages copy-on-write (from the moment it exists, and it never writes them), so they
# are resident in both and RSS counts them twice; the child also fills OWN bytes of its own.  On a
# line on stdin the child exits and the parent unmaps the memory ("freed").
SHARING = """
import mmap, os, sys
size, own = int(sys.argv[1]), int(sys.argv[2])
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
for i in range(0, size, mmap.PAGESIZE):
    buf[i] = 1
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    mine = b"\\1" * own
    print("shared", flush=True)
    os.read(r, 1)
    os._exit(0)
os.close(r)
sys.stdin.readline()
os.close(w)
os.wait()
buf.close()
print("freed", flush=True)
sys.stdin.readline()
"""


def _rss_bytes(pid: int) -> int:
    return sum(pss._status_kib(p, "VmRSS") for p in pss.tree(pid)) << 10


def test_peak_pss_counts_shared_memory_once_and_keeps_its_peak():
    size, own = 128 << 20, 32 << 20
    # leaving closes stdin: the script then runs to its end (the child exits, the memory goes)
    with subprocess.Popen([sys.executable, "-c", SHARING, str(size), str(own)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        with pss.PeakPss(proc.pid, interval=0.05) as sampler:  # started before the child exists
            assert proc.stdout.readline() == "shared\n"
            assert len(pss.tree(proc.pid)) == 2
            rss, now = _rss_bytes(proc.pid), pss.tree_pss_bytes(proc.pid)
            assert rss >= 2 * size + own  # each process's RSS holds the whole buffer
            assert size + own <= now < size + own + (32 << 20)  # PSS holds it once, beside two small interpreters
            deadline = time.monotonic() + 10
            while sampler.peak_bytes < size + own and time.monotonic() < deadline:  # the child found afresh
                time.sleep(0.05)
            proc.stdin.write("\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "freed\n"
            assert pss.tree(proc.pid) == [proc.pid] and pss.tree_pss_bytes(proc.pid) < size // 4
            time.sleep(0.2)  # samples after the memory went
    assert size + own <= sampler.peak_bytes < size + own + (32 << 20) < rss  # the peak is kept
    assert sampler.stop() == sampler.peak_bytes  # stopping again changes nothing
    assert pss.INTERVAL == pss.PeakPss(proc.pid).interval == 1.0  # e2e samples once a second


def test_processes_gone_before_they_are_read_are_skipped(monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    zombie = subprocess.Popen([sys.executable, "-c", ""])  # exited, not yet reaped: in /proc without memory
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert pss.pss_bytes(gone.pid) == pss.pss_bytes(zombie.pid) == 0
        assert pss.tree_pss_bytes(gone.pid) == 0
        here = os.getpid()
        monkeypatch.setattr(pss, "tree", lambda pid: [gone.pid, zombie.pid, here])  # listed, then gone
        with pss.PeakPss(here, interval=0.01) as sampler:
            time.sleep(0.05)
        assert sampler.peak_bytes > 0
    finally:
        zombie.wait()
