"""The read-only zero page over what a batched kernel call reads but no page
backs (`VirtualKVCache.zero_fill`), on a host backend that leaves unmapped
addresses inaccessible, as CUDA does: what is filled, that it goes before a
page grows there, that nothing writes it, and the engine's batched SDPA
decode over it."""
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import fill, live
from test_engine import engine_for, greedy, prompts, run
from tiny_models import tiny_model

from vattn.backends import HostBackend
from vattn.config import CacheConfig
from vattn.kv import virtual
from vattn.kv.virtual import VirtualKVCache

# 96 bytes a token per buffer (3 heads of 8 float32 dims): 4 KiB pages of 42 tokens and a bit
GEOMETRY = dict(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32)
TOKENS_PER_PAGE = 4096 // 96


class HostWithoutZeroPage(HostBackend):
    """The host backend with unmapped addresses left inaccessible, as on CUDA."""

    zero_backing = False


def cache_without_zero_page(max_num_seqs=4, layout="per_layer") -> VirtualKVCache:
    config = CacheConfig(**GEOMETRY, max_num_seqs=max_num_seqs, max_seq_len=400, page_size=4096, layout=layout)
    return VirtualKVCache(config, HostWithoutZeroPage())


def test_the_zero_page_goes_where_the_range_has_no_page_and_makes_it_readable(layout):
    cache = cache_without_zero_page(layout=layout)
    for slot, n in ((0, 10), (1, 200), (3, 50)):  # slot 2 is never allocated
        assert cache.allocate(n, slot=slot) == slot
        fill(cache, slot, n, seed=slot)
    cache.free(3)  # idle: its pages stay mapped
    need = cache.config.pages_for(200)
    assert not cache.data.readable(0, 4, 200)
    assert cache.data.readable(0, 4, 200, fill=True)
    assert cache.table.zero_filled == {(i, j) for i in range(4) for j in range(cache.mapped_pages(i), need)}
    assert cache.data.readable(0, 4, 200) and cache.data.readable(1, 3, 100)
    assert not cache.data.readable(0, 4, cache.config.tokens_in(need) + 1)  # a page further
    K, V = cache.data.rows(1, 0, 4, 200)  # reading every row faults nowhere
    assert float(K[0, cache.config.tokens_in(1):].abs().sum()) == 0 and float(V[2].abs().sum()) == 0
    assert cache.data.readable(0, 4, 200, fill=True)  # again: nothing more to map
    cache.check()


def test_a_range_that_does_not_fit_is_refused_and_nothing_is_filled():
    cache = cache_without_zero_page()
    cache.allocate(10, slot=0)
    for lo, hi, length, why in ((0, 5, 10, "slot 4 does not exist"), (2, 2, 10, "slots 2..1 are no range"),
                                (0, 2, 401, "max_seq_len=400")):
        with pytest.raises(ValueError, match=why):
            cache.data.readable(lo, hi, length, fill=True)
    assert not cache.table.zero_filled and not cache.data.readable(0, 2, 100)


def test_readable_lasts_until_the_cache_next_maps_or_unmaps():
    cache = cache_without_zero_page()
    for slot, n in ((0, 10), (1, 200)):
        cache.allocate(n, slot=slot)
    assert cache.data.readable(0, 2, 200, fill=True) and cache.data.readable(0, 2, 200)
    cache.grow(1, 250)  # maps: the worker may have taken a page the range counted on
    assert not cache.data.readable(0, 2, 200)
    assert cache.data.readable(0, 2, 200, fill=True) and cache.data.readable(0, 2, 200)
    cache.free(1)
    cache.trim()  # unmaps
    assert not cache.data.readable(0, 2, 200)


def test_a_page_grown_into_the_zero_page_takes_its_place_and_holds_what_is_written():
    cache = cache_without_zero_page()
    cache.allocate(10, slot=0)
    fill(cache, 0, 10)
    cache.allocate(300, slot=1)
    assert cache.data.readable(0, 2, 300, fill=True)
    filled_before = set(cache.table.zero_filled)
    assert cache.grow(0, 3 * TOKENS_PER_PAGE)
    grown = {(0, j) for j in range(1, 3)}
    assert grown <= filled_before and cache.table.zero_filled == filled_before - grown
    written = fill(cache, 0, 3 * TOKENS_PER_PAGE - 10, start=10, seed=5)
    for layer, (k, v) in enumerate(written):
        K, V = live(cache, 0, layer)
        assert torch.equal(K[10:], k) and torch.equal(V[10:], v)
    K, _ = cache.data.rows(0, 0, 1, 300)  # the pages still filled read zeros: the shared page took no write
    assert float(K[0, 3 * TOKENS_PER_PAGE:].abs().sum()) == 0
    cache.check()


def test_a_write_past_the_mapped_pages_is_refused_before_it_reaches_the_zero_page():
    cache = cache_without_zero_page()
    cache.allocate(2 * TOKENS_PER_PAGE, slot=0)
    fill(cache, 0, 40)
    assert cache.data.readable(0, 1, 300, fill=True)
    del cache.table.slots[0].pages[1:]  # pages the slot is sized for but lost: the write path must notice
    k = torch.ones(1, 10, 3, 8)
    with pytest.raises(ValueError, match="slot 0 maps 1 pages; writing 10 tokens at 40 needs 2"):
        cache.data.write(0, [0], [40], k, k)
    assert cache.length(0, 0) == 40  # nothing recorded


def test_the_zero_page_is_read_only_a_stray_write_faults():
    """Written through a view (no check in the way), the zero page faults the
    writing process: it cannot carry one slot's bytes into the others."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        from test_zero_fill import cache_without_zero_page
        cache = cache_without_zero_page()
        cache.allocate(10, slot=0)
        assert cache.data.readable(0, 2, 300, fill=True)
        K, _ = cache.data.rows(0, 0, 2, 300)
        print(float(K[1, 100].sum()), flush=True)  # reads: zeros
        K[1, 100] = 1.0  # writes: SIGSEGV
        print("written", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -11, done.stderr
    assert done.stdout == "0.0\n"


@pytest.mark.parametrize("map_ahead", [True, False])
def test_the_engines_sdpa_decodes_in_one_batched_call_over_the_zero_page(monkeypatch, map_ahead):
    model = tiny_model("llama", "sdpa")
    reqs = [(p, greedy()) for p in prompts()]
    outputs = {}
    for backend in (HostWithoutZeroPage(), HostBackend()):
        monkeypatch.setattr(virtual, "get_backend", lambda device: backend)  # the engine's cache is built on it
        engine = engine_for(model, attention="sdpa", map_ahead=map_ahead)
        outputs[backend.zero_backing] = run(engine, reqs)
        assert engine.kv.cache.storage.zero_backed == backend.zero_backing
        assert engine.stats.per_request_decodes == 0  # every decode one batched call
        assert bool(engine.kv.cache.table.zero_filled) != backend.zero_backing
        engine.kv.cache.check()
        engine.close()
    assert outputs[False] == outputs[True]
