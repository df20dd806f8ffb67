"""Sharing and swap: the moves of a slot's contents, over the slot table.

Sharing puts a page into several slots (counted in the page pool).  Only
pages wholly inside the shared prefix are shared; the partly filled tail page
is copied, and writes are refused on shared pages, so no slot ever changes
another's tokens.  Swap copies a slot's live bytes to host memory and gives
its pages back.
"""
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from vattn.kv.table import SlotTable


@dataclass(slots=True, frozen=True)
class SwappedSlot:
    """A slot's live bytes in host memory, from `swap_out`, for `swap_in`."""

    key: int
    data: torch.Tensor  # uint8 [num_buffers, live bytes]
    capacity: int
    written: tuple[int, ...]


def share(t: SlotTable, sources: Mapping[int, int], num_tokens: int) -> bool:
    """`SlotCache.share_many`."""
    c = t.config
    t.check_tokens(num_tokens)
    for dst, src in sources.items():
        t.active(dst)
        written = min(t.active(src).written)
        if num_tokens > written:
            raise ValueError(f"slot {src} has {written} tokens written in every layer; "
                             f"cannot share {num_tokens}")
    full, tail = divmod(num_tokens * c.token_bytes, c.page_size)
    before = {src: t.slots[src].pages[:] for src in set(sources.values())}
    taken, kept, fresh_for = {}, {}, []  # per dst: source pages to map in, own pages kept
    for dst, src in sources.items():
        b = t.slots[dst]
        same = min(full, len(b.pages))
        k = next((j for j in range(same) if b.pages[j] != before[src][j]), same)
        keep_tail = bool(tail) and k == full < len(b.pages) and full >= t.shared_prefix(b)
        taken[dst], kept[dst] = before[src][k:full], full + 1 if keep_tail else k
        if tail and not keep_tail:
            fresh_for.append(dst)
        elif keep_tail:
            t.pool.forget([b.pages[full]])  # its tail is rewritten below
    drops = [(dst, j) for dst, k in kept.items() for j in range(k, len(t.slots[dst].pages))]
    refs = Counter(p for pages in taken.values() for p in pages)
    refs.subtract(t.slots[dst].pages[j] for dst, j in drops)
    freed = sum(1 for p, n in refs.items() if t.pool.refs[p] + n == 0)
    whole = {i: c.max_seq_len for i in set(sources) | set(sources.values())}  # these keep every page
    if not t.has_room(len(fresh_for) - freed, whole):
        return False

    start = full * c.page_size
    tails = {src: t.read(src, start, tail).clone() for src in set(sources.values())}
    t.pool.retain([p for pages in taken.values() for p in pages])  # before any source lets go
    t.cut(kept)
    t.make_room(len(fresh_for), whole)
    fresh = dict(zip(fresh_for, t.pool.allocate(len(fresh_for))))
    entries, pages = [], []
    for dst, k in kept.items():
        new = taken[dst] + ([fresh[dst]] if dst in fresh else [])
        entries += [(dst, j) for j in range(k, k + len(new))]
        pages += new
    t.attach(entries, pages)
    for dst, src in sources.items():
        t.write(dst, start, tails[src])
        b = t.slots[dst]
        b.capacity, b.written, b.shared_pages = num_tokens, [num_tokens] * c.num_layers, full
        t.slots[src].shared_pages = max(t.slots[src].shared_pages, full)
    return True


def swap_out(t: SlotTable, slot: int) -> SwappedSlot:
    """A copy of the slot's live bytes in host memory; its pages go back and it goes idle."""
    s = t.active(slot)
    src = t.read(slot, 0, max(s.written) * t.config.token_bytes)
    data = torch.empty(src.shape, dtype=torch.uint8, pin_memory=src.is_cuda)  # pinned: DMA both ways
    data.copy_(src)
    swapped = SwappedSlot(next(t.clock), data, s.capacity, tuple(s.written))
    t.cut({slot: 0})
    t.make_idle(s)
    return swapped


def restore(t: SlotTable, slot: int, swapped: SwappedSlot) -> None:
    """Put swapped-out bytes into a slot allocated for them."""
    t.write(slot, 0, swapped.data)
    t.slots[slot].written = list(swapped.written)
