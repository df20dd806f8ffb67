"""The README's scheduler loop over the cache API serves real requests: its
tokens equal HF generate()'s, with prefix hits and under preemption."""
import importlib.util
from pathlib import Path

import pytest
import torch
from test_engine import hf_greedy
from tiny_models import SMALL, tiny_model

from vattn import CacheConfig, KVCacheManager
from vattn.config import resolve

ROOT = Path(__file__).parent.parent
LOOP = ROOT / "examples" / "scheduler_loop.py"


def load_loop():
    spec = importlib.util.spec_from_file_location("scheduler_loop", LOOP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.serve


def test_the_readme_shows_the_loop_as_it_is_tested():
    assert LOOP.read_text() in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("budget_pages", [None, 3], ids=["roomy", "preempting"])
def test_the_loop_equals_hf_generate(budget_pages, monkeypatch):
    frees, hits = [], []
    monkeypatch.setattr(KVCacheManager, "free", lambda kv, seq, free=KVCacheManager.free: (frees.append(seq),
                                                                                          free(kv, seq)))
    monkeypatch.setattr(KVCacheManager, "allocate", lambda kv, *args, allocate=KVCacheManager.allocate: (
        hits.append(allocate(kv, *args)), hits[-1])[1])
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, SMALL["eos_token_id"], (130,), generator=g).tolist()  # a page of 128 tokens and more
    prompts = [system + torch.randint(2, 90, (n,), generator=g).tolist() for n in (5, 9, 3, 20, 7)]
    reference = [hf_greedy(tiny_model("llama", "sdpa"), p, 12, ignore_eos=True) for p in prompts]
    model = tiny_model("llama", "sdpa")
    page = resolve(CacheConfig.from_model(model)).page_bytes  # the host's default page, in every buffer
    budget = budget_pages and budget_pages * page
    assert load_loop()(model, prompts, 12, memory_budget=budget) == reference
    assert (len(frees) > len(prompts)) == (budget is not None)  # preempted sequences are freed twice or more
    assert 128 in hits  # later prompts resume the system prompt's first page
