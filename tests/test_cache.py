"""The virtual KV cache on the real host backend."""
import subprocess
import sys

import pytest
import torch

from conftest import fill, make_cache, physical_bytes, live


def test_geometry(layout):
    cache = make_cache(layout)
    c = cache.config
    K, V = cache.data.views(1)
    assert K.shape == V.shape == (c.max_num_seqs, c.max_seq_len, c.num_kv_heads, c.head_dim)
    assert K.stride()[-1] == 1 and K.dtype == c.dtype
    H, D = c.num_kv_heads, c.head_dim
    if layout == "interleaved":  # [B, S, L, 2, H, D] viewed at [:, :, l, kv]
        assert c.num_buffers == 1 and K.stride(1) == c.num_layers * 2 * H * D
        assert V.data_ptr() - K.data_ptr() == H * D * 4
    elif layout == "per_head":  # a buffer per (layer, K/V, head): each head's tokens contiguous
        assert c.num_buffers == 2 * c.num_layers * H and K.stride(1) == D
        assert K.transpose(1, 2)[0, 1, :5].is_contiguous()
    else:
        assert c.num_buffers == 2 * c.num_layers and K.stride(1) == H * D


def test_write_and_read_back(layout):
    cache = make_cache(layout)
    a, b = cache.allocate(60), cache.allocate(10)
    data = fill(cache, a, 50)
    k2, v2 = (torch.randn(2, 3, 3, 8) for _ in "kv")
    for layer in range(2):
        cache.data.write(layer, [a, b], [50, 0], k2, v2)  # several slots, each at its own position
    for layer, (k, v) in enumerate(data):
        ka, va = live(cache, a, layer)
        assert torch.equal(ka, torch.cat([k, k2[0]])) and torch.equal(va, torch.cat([v, v2[0]]))
        kb, vb = live(cache, b, layer)
        assert torch.equal(kb, k2[1]) and torch.equal(vb, v2[1])
    assert cache.length(a) == 53 and cache.capacity(a) == 60
    K, _ = cache.data.views(0)
    assert torch.equal(K[a, :50], data[0][0])  # the kernel view sees the same memory
    cache.check()


def test_data_lands_in_the_physical_page(layout):
    cache = make_cache(layout)
    slot = cache.allocate(100)
    fill(cache, slot, 100)
    c = cache.config
    raw = cache.storage.bytes[:, slot]
    for j, group in enumerate(cache.block_table(slot)):
        for buffer in range(c.num_buffers):
            page = raw[buffer, j * c.page_size:(j + 1) * c.page_size]
            assert torch.equal(physical_bytes(cache, group, buffer), page)
    assert physical_bytes(cache, cache.block_table(slot)[0], 0).any()


def test_memory_is_committed_only_when_touched():
    cache = make_cache(page_size=2 << 20, max_seq_len=4096, max_num_seqs=8)
    c = cache.config
    slots = [cache.allocate(4096) for _ in range(8)]
    st = cache.stats()
    assert st.mapped_bytes == 8 * c.pages_per_slot * c.page_bytes and st.committed_bytes == 0
    fill(cache, slots[3], 1)
    # one OS page touched in each of the 2·L buffers
    assert cache.stats().committed_bytes == c.num_buffers * cache.backend.granularity
    fill(cache, slots[3], 2000, start=1)
    touched = -(-2001 * c.token_bytes // 4096) * 4096 * c.num_buffers
    assert cache.stats().committed_bytes == touched


def test_mapping_grows_page_by_page(layout):
    cache = make_cache(layout)
    c = cache.config
    slot = cache.allocate(1)
    fill(cache, slot, 1)
    for n in range(2, c.max_seq_len + 1):
        assert cache.grow(slot, n)
        assert cache.mapped_pages(slot) == c.pages_for(n)
        fill(cache, slot, 1, start=n - 1)
        st = cache.stats()
        assert st.mapped_bytes - st.live_bytes < c.page_bytes
    assert cache.map_calls == c.pages_per_slot


def test_unmapped_memory_reads_as_zeros(layout):
    cache = make_cache(layout)
    K, V = cache.data.views(0)
    assert float(K.abs().sum()) == 0 and float(V.abs().sum()) == 0
    slot = cache.allocate(5)
    fill(cache, slot, 5)
    assert float(K.abs().sum()) > 0  # and the whole buffer is still readable


def test_freed_slot_is_reused_without_mapping(layout):
    cache = make_cache(layout)
    slot = cache.allocate(150)
    fill(cache, slot, 150)
    cache.free(slot)
    st = cache.stats()
    assert st.pages_idle == st.pages_mapped > 0 and st.active_slots == 0
    calls = cache.map_calls
    again = cache.allocate(120)
    assert again == slot and cache.map_calls == calls
    assert live(cache, again, 0)[0].shape[0] == 0  # nothing of the previous owner is visible
    fill(cache, again, 3, seed=5)
    assert live(cache, again, 1)[0].shape[0] == 3
    cache.check()


def test_best_fit_among_idle_slots():
    cache = make_cache()
    c = cache.config
    big, small, mid = cache.allocate(190), cache.allocate(10), cache.allocate(100)
    for s in (big, small, mid):
        cache.free(s)
    assert cache.allocate(5) == small
    assert cache.allocate(90) == mid
    assert cache.mapped_pages(big) == c.pages_for(190)


def test_pressure_reclaims_idle_pages(layout):
    c = make_cache(layout).config
    half = c.max_seq_len // 2
    cache = make_cache(layout, pages=2 * c.pages_for(half))  # two half slots, or one full one
    a, b = cache.allocate(half), cache.allocate(half)
    assert a is not None and b is not None
    cache.free(a)
    cache.free(b)
    unmaps = cache.unmap_calls
    full = cache.allocate(c.max_seq_len)  # needs the other idle slot's pages
    assert full is not None and cache.unmap_calls > unmaps
    left = 2 * c.pages_for(half) - c.pages_per_slot  # only what was missing was reclaimed, from the tail
    assert cache.stats().pages_free == 0 and cache.stats().pages_idle == left
    assert not cache.can_allocate(c.max_seq_len) and cache.allocate(c.max_seq_len) is None
    cache.free(full)
    assert cache.can_allocate(c.max_seq_len)
    cache.check()


def test_trim_returns_idle_memory(layout):
    cache = make_cache(layout)
    slot = cache.allocate(150)
    fill(cache, slot, 150)
    cache.free(slot)
    before = cache.stats()
    assert before.committed_bytes > 0
    assert cache.trim() == before.pages_idle
    after = cache.stats()
    assert after.pages_free == after.pages_total and after.committed_bytes == 0
    slot = cache.allocate(150)  # fresh pages read as zeros
    K, _ = cache.data.views(0)
    assert float(K[slot].abs().sum()) == 0


def test_grow_is_all_or_nothing(layout):
    c = make_cache(layout).config
    cache = make_cache(layout, pages=c.pages_per_slot + 1)
    a, b = cache.allocate(c.max_seq_len), cache.allocate(1)
    assert not cache.can_grow(b, c.max_seq_len)
    before = cache.stats()
    assert not cache.grow_many({b: c.max_seq_len, a: c.max_seq_len})
    assert cache.stats() == before
    cache.free(a)
    assert cache.grow(b, c.max_seq_len)  # takes a's idle pages


def test_shared_pages_see_the_same_bytes(layout):
    cache = make_cache(layout)
    c = cache.config
    a = cache.allocate(150)
    data = fill(cache, a, 150)
    n = 130
    b = cache.fork(a, n)
    assert b is not None
    full = n * c.token_bytes // c.page_size
    st = cache.stats()
    assert st.pages_shared == full
    for layer, (k, v) in enumerate(data):
        kb, vb = live(cache, b, layer)
        assert torch.equal(kb, k[:n]) and torch.equal(vb, v[:n])
    # a byte written into a shared page (through the kernel view) shows in both slots
    K, _ = cache.data.views(0)
    K[a, 0, 0, 0] = 1234.0
    assert float(live(cache, b, 0)[0][0, 0, 0]) == 1234.0
    # the tail page was copied: a change past the shared pages shows in one slot only
    last = n - 1
    assert last * c.token_bytes >= full * c.page_size
    K[a, last, 0, 0] = -1.0
    assert float(live(cache, b, 0)[0][last, 0, 0]) == float(data[0][0][last, 0, 0])
    # writes may not land on a shared page
    with pytest.raises(ValueError, match="shares with another slot"):
        cache.data.write(0, [b], [0], *(torch.zeros(1, 1, 3, 8) for _ in "kv"))
    assert cache.grow(b, n + 5)
    fill(cache, b, 5, start=n)  # appending past the shared pages is fine
    cache.check()
    cache.free(a)  # b keeps the shared pages, now privately
    assert cache.stats().pages_shared == 0
    assert torch.equal(live(cache, b, 1)[0][:n], data[1][0][:n])
    cache.data.write(0, [b], [0], *(torch.zeros(1, 1, 3, 8) for _ in "kv"))  # private again: writable
    cache.check()


def test_share_into_an_existing_slot(layout):
    cache = make_cache(layout)
    a, b = cache.allocate(180), cache.allocate(180)
    data_a = fill(cache, a, 180, seed=1)
    fill(cache, b, 180, seed=2)
    free_before = cache.stats().pages_free
    assert cache.share(a, b, 100)
    assert cache.length(b) == 100 and cache.capacity(b) == 100
    for layer, (k, v) in enumerate(data_a):
        assert torch.equal(live(cache, b, layer)[0], k[:100])
    assert cache.stats().pages_free > free_before  # b's own pages went back
    assert cache.share(a, b, 100) and cache.map_calls  # again: nothing to change
    cache.check()


def test_swap_round_trip(layout):
    cache = make_cache(layout)
    c = cache.config
    slot = cache.allocate(160)
    data = fill(cache, slot, 140)
    extra = torch.randn(1, 10, 3, 8)
    cache.data.write(0, [slot], [140], extra, extra)  # layer 0 ahead of layer 1
    raw = cache.storage.bytes[:, slot, :150 * c.token_bytes].clone()
    free = cache.stats().pages_free
    swapped = cache.swap_out(slot)
    assert cache.stats().pages_free == free + c.pages_for(160)
    other = cache.allocate(50)  # someone else uses the memory meanwhile
    fill(cache, other, 50, seed=9)
    back = cache.swap_in(swapped)
    assert back is not None and back != other
    assert cache.stats().pages_free == free - c.pages_for(50)
    assert torch.equal(cache.storage.bytes[:, back, :150 * c.token_bytes], raw)
    assert live(cache, back, 0)[0].shape[0] == 150 and live(cache, back, 1)[0].shape[0] == 140
    assert torch.equal(live(cache, back, 1)[1], data[1][1])
    with pytest.raises(ValueError, match="already swapped in"):
        cache.swap_in(swapped)
    cache.check()


def test_swap_in_waits_for_memory(layout):
    c = make_cache(layout).config
    cache = make_cache(layout, pages=c.pages_per_slot)
    a = cache.allocate(c.max_seq_len)
    swapped = cache.swap_out(a)
    b = cache.allocate(c.max_seq_len)
    assert cache.swap_in(swapped) is None  # no room: nothing changes
    cache.free(b)
    assert cache.swap_in(swapped) is not None


def test_stats_count_shared_bytes_once(layout):
    cache = make_cache(layout)
    a = cache.allocate(200)
    fill(cache, a, 200)
    one = cache.stats().live_bytes
    for _ in range(3):
        cache.fork(a, 200)
    st = cache.stats()
    c = cache.config
    tail = 200 * c.token_bytes % c.page_size  # each fork copies only the partly filled page
    assert st.live_bytes == one + 3 * tail * c.num_buffers
    assert st.utilization <= 1.0 and st.active_slots == 4


SEGV_SCRIPT = """
import torch
from conftest import make_cache, fill
for layout in ("per_layer", "per_head", "interleaved"):
    cache = make_cache(layout)
    a = cache.allocate(200); fill(cache, a, 200)
    b = cache.fork(a, 77); cache.free(a); cache.trim()
    for layer in range(2):
        K, V = cache.data.views(layer)
        total = float(K.sum()) + float(V.sum()) + float(K.abs().max())  # every byte of every slot
    s = cache.swap_out(b); cache.trim()
    for layer in range(2):
        float(cache.data.views(layer)[0].sum())
print("read everything")
"""


def test_reading_every_view_never_faults():
    out = subprocess.run([sys.executable, "-c", SEGV_SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=__file__.rsplit("/", 1)[0])
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr}"
    assert "read everything" in out.stdout


def test_reshare_a_shorter_prefix_keeps_writes_private(layout):
    """dst already shares src's page where its new tail falls: the tail must become private."""
    cache = make_cache(layout)
    c = cache.config
    a = cache.allocate(200)
    data = fill(cache, a, 200)
    b = cache.fork(a, 190)
    n = next(n for n in range(100, 180) if n * c.token_bytes % c.page_size)  # a tail in a shared page
    assert cache.share(a, b, n) and cache.grow(b, n + 10)
    fill(cache, b, 10, start=n, seed=3)
    for layer, (k, v) in enumerate(data):
        assert torch.equal(live(cache, a, layer)[0], k) and torch.equal(live(cache, a, layer)[1], v)
    cache.check()


def test_slots_trade_contents(layout):
    """share_many reads every source as it was before the call, as a beam reorder needs."""
    cache = make_cache(layout)
    slots = [cache.allocate(150) for _ in range(3)]
    data = [fill(cache, s, 150, seed=i) for i, s in enumerate(slots)]
    n = 140
    assert cache.share_many({slots[0]: slots[1], slots[1]: slots[0], slots[2]: slots[0]}, n)
    for dst, src in ((0, 1), (1, 0), (2, 0)):
        for layer in range(2):
            k, v = live(cache, slots[dst], layer)
            assert torch.equal(k, data[src][layer][0][:n]) and torch.equal(v, data[src][layer][1][:n])
    c = cache.config
    # slot 0's old full pages are in slots 1 and 2; slot 1's moved to slot 0 alone
    assert cache.stats().pages_shared == n * c.token_bytes // c.page_size
    cache.check()


def test_truncate_makes_the_new_tail_private(layout):
    cache = make_cache(layout)
    a = cache.allocate(200)
    data = fill(cache, a, 200)
    b = cache.fork(a, 200)
    n = 50
    assert cache.truncate(b, n) and cache.length(b) == n and cache.grow(b, n + 20)
    fill(cache, b, 20, start=n, seed=4)  # lands on b's own pages
    assert torch.equal(live(cache, a, 0)[0], data[0][0])
    assert torch.equal(live(cache, b, 1)[1][:n], data[1][1][:n])
    cache.check()


def test_allocate_and_fork_a_given_slot(layout):
    cache = make_cache(layout)
    assert cache.allocate(10, slot=2) == 2
    fill(cache, 2, 10)
    assert cache.fork(2, 10, slot=0) == 0
    assert torch.equal(live(cache, 0, 1)[0], live(cache, 2, 1)[0])
    assert cache.can_allocate(5, slot=1) and not cache.can_allocate(5, slot=2)


def test_trade_with_every_page_in_use(layout):
    """The pages a reorder lets go of pay for the tail pages it needs."""
    c = make_cache(layout).config
    cache = make_cache(layout, max_num_seqs=2, pages=2 * c.pages_for(150))
    a, b = cache.allocate(150), cache.allocate(150)
    da, db = fill(cache, a, 150, seed=1), fill(cache, b, 150, seed=2)
    assert cache.stats().pages_free == 0
    assert cache.share_many({a: b, b: a}, 150)
    assert torch.equal(live(cache, a, 1)[0], db[1][0]) and torch.equal(live(cache, b, 0)[1], da[0][1])
    cache.check()


def test_an_idle_slot_resumes_its_previous_tokens(layout):
    cache = make_cache(layout)
    c = cache.config
    slot = cache.allocate(150)
    data = fill(cache, slot, 150)
    cache.free(slot)
    kept = c.pages_for(150) * c.page_size // c.token_bytes
    assert cache.retained(slot) == kept >= 150
    assert cache.available_pages() == cache.pool.num_pages  # free + idle: everything
    calls = cache.map_calls
    assert cache.allocate(180, slot=slot, resume=100) == slot
    assert cache.length(slot) == 100 and cache.capacity(slot) == 180
    k, v = live(cache, slot, 1)
    assert torch.equal(k, data[1][0][:100]) and torch.equal(v, data[1][1][:100])
    assert cache.map_calls == calls + (c.pages_for(180) > c.pages_for(150))
    fill(cache, slot, 5, start=100, seed=3)  # the new owner continues after the kept tokens
    assert cache.length(slot) == 105
    cache.check()


def idle_slot_in_a_tight_cache(layout, tokens):
    """(cache, config, slot): a budget of one page group more than `tokens`
    need, and an idle slot that holds those pages."""
    c = make_cache(layout).config
    cache = make_cache(layout, pages=c.pages_for(tokens) + 1)
    slot = cache.allocate(tokens)
    cache.free(slot)
    return cache, c, slot


def test_reclaimed_pages_are_no_longer_retained(layout):
    cache, c, slot = idle_slot_in_a_tight_cache(layout, 150)
    assert cache.allocate(c.page_size // c.token_bytes + 1, slot=slot + 1) is not None  # two pages: one reclaimed
    assert cache.mapped_pages(slot) == c.pages_for(150) - 1
    assert cache.retained(slot) == (c.pages_for(150) - 1) * c.page_size // c.token_bytes
    assert cache.available_pages() == c.pages_for(150) - 1


def test_shrink_unmaps_what_a_reused_slot_holds_past_its_size(layout):
    cache = make_cache(layout)
    c = cache.config
    slot = cache.allocate(190)
    cache.free(slot)
    assert cache.allocate(30) == slot and cache.mapped_pages(slot) == c.pages_for(190)
    data = fill(cache, slot, 30)
    unmaps = cache.unmap_calls
    assert cache.shrink([slot]) == c.pages_for(190) - c.pages_for(30)
    assert cache.mapped_pages(slot) == c.pages_for(30) and cache.unmap_calls == unmaps + 1
    assert cache.shrink([slot]) == 0
    assert torch.equal(live(cache, slot, 0)[0], data[0][0])
    st = cache.stats()
    assert st.pages_free == st.pages_total - c.pages_for(30)
    cache.check()


def test_a_discarded_swap_is_gone(layout):
    cache = make_cache(layout)
    swapped = cache.swap_out(cache.allocate(40))
    cache.discard(swapped)
    for call in (cache.swap_in, cache.discard):
        with pytest.raises(ValueError, match="already swapped in"):
            call(swapped)
    cache.check()


def test_what_a_reused_slot_holds_past_its_size_is_reclaimable(layout):
    cache, c, slot = idle_slot_in_a_tight_cache(layout, 190)
    assert cache.allocate(10, slot=slot) == slot and cache.mapped_pages(slot) == c.pages_for(190)
    data = fill(cache, slot, 10)
    assert cache.available_pages() == 1 + c.pages_for(190) - c.pages_for(10)
    other = cache.allocate(190)  # takes the surplus from the slot's tail
    assert other is not None and cache.mapped_pages(slot) == c.pages_for(10)
    assert torch.equal(live(cache, slot, 1)[1], data[1][1])
    assert cache.grow(slot, c.page_size // c.token_bytes + 10) is False  # nothing spare is left
    cache.check()


def test_live_rows_are_views_of_the_virtual_cache_and_copies_of_the_paged_one():
    for layout in ("per_head", "paged"):
        cache = make_cache(layout)
        slot = cache.allocate(10)
        fill(cache, slot, 10)
        k, _ = live(cache, slot, 0)
        cache.data.write(0, [slot], [0], torch.full((1, 1, 3, 8), 7.0), torch.zeros(1, 1, 3, 8))
        assert (float(k[0, 0, 0]) == 7.0) == (layout != "paged")
