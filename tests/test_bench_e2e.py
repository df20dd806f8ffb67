"""The end-to-end benchmark's rules: every system's KV memory within one budget, and arrivals as
`vllm bench serve` draws them (the systems themselves run in tests/test_cli.py)."""
import statistics

import pytest
import torch

from vattn.bench import e2e
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
    assert vllm["kv_budget_bytes"] == BUDGET and vllm["dtype"] == "float32" and vllm["max_model_len"] == 2048
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

    from vattn.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
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
