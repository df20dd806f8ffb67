"""The caches hold the mapping entries they take to a budget under vm.max_map_count."""
import gc
import random

import pytest

from conftest import fill, make_cache
from vattn.backends import MapLimitError, map_entries


def entries_in(reservation) -> int:
    """The lines of /proc/self/maps that lie in the reservation."""
    lo, hi = reservation.addr, reservation.addr + reservation.nbytes
    n = 0
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        n += start < hi and end > lo
    return n


@pytest.mark.parametrize("layout", ["per_layer", "per_head", "interleaved"])
def test_the_entries_drawn_bound_the_entries_the_reservation_takes(layout):
    cache = make_cache(layout, max_num_seqs=6, max_seq_len=300, page_size=4096)
    c, t, rng = cache.config, cache.table, random.Random(0)
    t.pool.spread = False  # the lowest pages first, as in a shared pool: slots growing in turn interleave
    live = []
    for step in range(150):
        op = rng.random()
        if live and op < 0.25:
            cache.free(live.pop(rng.randrange(len(live))))
        elif live and op < 0.35:
            slot = cache.fork(rng.choice(live), 1 + rng.randrange(min(max(t.slots[s].written) for s in live) or 1))
            if slot is not None:
                live.append(slot)
        elif live and op < 0.8:  # grow a page at a time, in turn, so that slots' pages interleave in the pool
            s = rng.choice(live)
            cap = t.slots[s].capacity
            if cap < c.max_seq_len and cache.grow(s, min(c.max_seq_len, cap + rng.randint(1, 60))):
                fill(cache, s, t.slots[s].capacity - max(t.slots[s].written), start=max(t.slots[s].written))
        else:
            slot = cache.allocate(rng.randint(1, 120))
            if slot is not None:
                fill(cache, slot, t.slots[slot].capacity)
                live.append(slot)
        cache.check()
        assert entries_in(cache.storage.reservation) <= c.num_buffers * t.entries + 1, step
    assert t.entries > 2 * c.max_num_seqs  # the pages did interleave: more runs than slots


@pytest.fixture
def small_budget(monkeypatch):
    """The process's budget, made to leave 100 entries for caches."""
    budget = map_entries.Budget(8000, 8000 - 8000 // map_entries.RESERVE - 100)
    monkeypatch.setattr(map_entries, "_budget", budget)
    return budget


def test_a_cache_stops_at_the_budget_as_if_memory_were_short(small_budget):
    cache = make_cache("per_layer", max_num_seqs=8, max_seq_len=400, page_size=4096)
    c, t = cache.config, cache.table
    t.pool.spread = False  # the lowest pages first, as in a shared pool
    slots = [cache.allocate(40) for _ in range(4)]  # a page each: 2 entries in each of the 4 buffers
    refused = 0
    for tokens in range(80, 401, 40):  # a page at a time, in turn: no slot's pages are consecutive in the pool
        for s in slots:
            refused += not cache.grow(s, tokens)
    assert refused and t.pool.num_free > t.config.pages_for(400)  # refused for entries, not for memory
    assert t.map_limit_hits == refused
    assert 0 <= small_budget.left < c.num_buffers
    assert small_budget.left == 100 - c.num_buffers * t.entries
    cache.check()
    for s in slots:
        cache.free(s)
    del cache, t
    gc.collect()
    assert small_budget.left == 100  # given back when the cache goes


def test_slots_growing_in_turn_keep_their_pages_consecutive_and_stay_within_the_budget(small_budget):
    """As above, but with the pool placing pages as a cache's own pool does: each slot grows in place."""
    cache = make_cache("per_layer", max_num_seqs=8, max_seq_len=400, page_size=4096)
    slots = [cache.allocate(40) for _ in range(4)]
    for tokens in range(80, 401, 40):
        for s in slots:
            assert cache.grow(s, tokens)
    assert cache.table.entries == 2 * len(slots) and cache.map_limit_hits == 0  # one run each
    cache.check()


def test_caches_share_the_budget(small_budget):
    a, b = (make_cache("per_layer", max_num_seqs=8, max_seq_len=400, page_size=4096) for _ in "ab")
    assert all(a.allocate(40) is not None for _ in range(8))  # 8 entries each: 64 of the 100
    got = [b.allocate(40) for _ in range(8)]
    assert got == [0, 1, 2, 3, None, None, None, None]  # the 36 left take four
    a.table.cut({i: 0 for i in range(8)})
    assert b.allocate(40) is not None


def test_a_draw_past_the_budget_names_the_limit_and_takes_nothing(small_budget):
    with pytest.raises(MapLimitError, match="vm.max_map_count=8000"):
        small_budget.draw(101)
    assert small_budget.left == 100
    small_budget.draw(100)
    assert small_budget.left == 0
