"""What a cache can say about itself: its figures and a consistency check, read off its slot table."""
from collections import Counter
from dataclasses import dataclass

from vattn.kv.table import SlotTable, slot_entries


@dataclass(slots=True, frozen=True)
class CacheStats:
    pages_total: int  # pages in the budget, or held of a shared pool (a page: page j of a slot in every buffer)
    pages_free: int
    pages_mapped: int  # in use by at least one slot, active or idle
    pages_idle: int  # held only by idle slots: reclaimable
    pages_shared: int  # mapped into more than one slot
    mapped_bytes: int
    live_bytes: int  # bytes of tokens written, each shared byte counted once
    utilization: float  # live / mapped
    committed_bytes: int  # physical memory the storage holds now
    active_slots: int
    swapped_slots: int  # swapped out, not yet back or discarded
    map_calls: int  # batched calls that put pages into slots
    unmap_calls: int  # batched calls that took pages out
    map_limit_hits: int  # operations refused at the process's limit on mappings


def of(t: SlotTable, swapped: int) -> CacheStats:
    """The figures of the table's cache, `swapped` slots out of it."""
    c = t.config
    live: dict[int, int] = {}  # page -> live bytes in it, per buffer
    for s in t.slots:
        nbytes = max(s.written) * c.token_bytes
        for j, page in enumerate(s.pages[:c.pages_for(max(s.written))]):
            live[page] = max(live.get(page, 0), min(c.page_size, nbytes - j * c.page_size))
    mapped = t.pool.num_used * c.page_bytes
    live_bytes = sum(live.values()) * c.num_buffers
    return CacheStats(
        pages_total=t.pool.num_held,
        pages_free=t.pool.num_free,
        pages_mapped=t.pool.num_used,
        pages_idle=sum(len(s.pages) for s in t.slots if not s.active),
        pages_shared=t.pool.num_shared,
        mapped_bytes=mapped,
        live_bytes=live_bytes,
        utilization=live_bytes / mapped if mapped else 0.0,
        committed_bytes=t.storage.committed_bytes(),
        active_slots=sum(s.active for s in t.slots),
        swapped_slots=swapped,
        map_calls=t.map_calls,
        unmap_calls=t.unmap_calls,
        map_limit_hits=t.map_limit_hits,
    )


def check(t: SlotTable) -> None:
    """Assert the bookkeeping is consistent: each page's reference count
    equals the slots that map it, free pages are mapped nowhere and carry
    no prefix hash, idle slots hold only private pages, active slots
    cover their capacity, and the mapping entries drawn are the slots'."""
    mapped = Counter(p for s in t.slots for p in s.pages)
    free = t.pool.free_pages()
    assert len(set(free)) == len(free), "a page is on the free list twice"
    assert set(free).isdisjoint(mapped), "a free page is mapped"
    assert len(free) + len(mapped) == t.pool.num_held, "a page held is neither free nor mapped"
    assert all(t.pool.is_held(p) for p in mapped), "a page not held is mapped"
    assert all(t.pool.hash_of(p) is None for p in free), "a free page carries a prefix hash"
    for p, count in mapped.items():
        assert t.pool.refs[p] == count, f"page {p}: {t.pool.refs[p]} references, {count} mappings"
    for i, s in enumerate(t.slots):
        if s.active:
            assert len(s.pages) >= t.config.pages_for(s.capacity), \
                f"slot {i} does not cover its {s.capacity} tokens"
            assert max(s.written) <= s.capacity, f"slot {i} has tokens written past its capacity"
        else:
            assert not any(s.written), f"idle slot {i} has tokens written"
            assert all(t.pool.refs[p] == 1 for p in s.pages), f"idle slot {i} holds a shared page"
    assert t.entries == sum(slot_entries(s.pages, t.run) for s in t.slots), \
        "the mapping entries drawn are not the slots'"
