"""Sharing and swap, the part of `SlotCache` that moves a slot's contents.

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

from vattn.kv.storage import short_at_map_limit


@dataclass(slots=True, frozen=True)
class SwappedSlot:
    """A slot's live bytes in host memory, from `swap_out`, for `swap_in`."""

    key: int
    data: torch.Tensor  # uint8 [num_buffers, live bytes]
    capacity: int
    written: tuple[int, ...]


class Sharing:
    """Mixed into `SlotCache` (`vattn.kv.slots`), whose bookkeeping it uses."""

    def share(self, src: int, dst: int, num_tokens: int) -> bool:
        """Make `dst` a slot of `num_tokens` tokens equal to the first
        `num_tokens` of `src` (see `share_many`)."""
        return self.share_many({dst: src}, num_tokens)

    @short_at_map_limit(False)
    def share_many(self, sources: Mapping[int, int], num_tokens: int) -> bool:
        """Make each slot `dst` in `sources` a slot of `num_tokens` tokens equal
        to the first `num_tokens` of `sources[dst]` as it was before the call
        (so slots may trade contents, as beams do).  Full pages are mapped into
        `dst` (shared), the partly filled tail page is copied into a private
        page, and `dst`'s other pages are let go.  With `dst == src` the slot
        is cut to `num_tokens`.  False (nothing changed) if memory is short."""
        c = self.config
        self._check_tokens(num_tokens)
        for dst, src in sources.items():
            self._active(dst)
            written = min(self._active(src).written)
            if num_tokens > written:
                raise ValueError(f"slot {src} has {written} tokens written in every layer; "
                                 f"cannot share {num_tokens}")
        full, tail = divmod(num_tokens * c.token_bytes, c.page_size)
        before = {src: self._slots[src].pages[:] for src in set(sources.values())}
        taken, kept, fresh_for = {}, {}, []  # per dst: source pages to map in, own pages kept
        for dst, src in sources.items():
            b = self._slots[dst]
            same = min(full, len(b.pages))
            k = next((j for j in range(same) if b.pages[j] != before[src][j]), same)
            keep_tail = bool(tail) and k == full < len(b.pages) and full >= self._shared_prefix(b)
            taken[dst], kept[dst] = before[src][k:full], full + 1 if keep_tail else k
            if tail and not keep_tail:
                fresh_for.append(dst)
            elif keep_tail:
                self.pool.forget([b.pages[full]])  # its tail is rewritten below
        drops = [(dst, j) for dst, k in kept.items() for j in range(k, len(self._slots[dst].pages))]
        refs = Counter(p for pages in taken.values() for p in pages)
        refs.subtract(self._slots[dst].pages[j] for dst, j in drops)
        freed = sum(1 for p, n in refs.items() if self.pool.refs[p] + n == 0)
        whole = {i: c.max_seq_len for i in set(sources) | set(sources.values())}  # these keep every page
        if not self._has_room(len(fresh_for) - freed, whole):
            return False

        start = full * c.page_size
        tails = {src: self._read(src, start, tail).clone() for src in set(sources.values())}
        self.pool.retain([p for pages in taken.values() for p in pages])  # before any source lets go
        self._cut_many(kept)
        self._make_room(len(fresh_for), whole)
        fresh = dict(zip(fresh_for, self.pool.allocate(len(fresh_for))))
        entries, pages = [], []
        for dst, k in kept.items():
            new = taken[dst] + ([fresh[dst]] if dst in fresh else [])
            entries += [(dst, j) for j in range(k, k + len(new))]
            pages += new
        self._attach(entries, pages)
        for dst, src in sources.items():
            self._write(dst, start, tails[src])
            b = self._slots[dst]
            b.capacity, b.written, b.shared_pages = num_tokens, [num_tokens] * c.num_layers, full
            self._slots[src].shared_pages = max(self._slots[src].shared_pages, full)
        return True

    def truncate(self, slot: int, num_tokens: int) -> bool:
        """Cut the slot to its first `num_tokens` tokens."""
        return self.share_many({slot: slot}, num_tokens)

    def fork(self, src: int, num_tokens: int, slot: int | None = None) -> int | None:
        """A new slot (the idle `slot` asked for, or the idle slot holding the
        fewest pages) whose first `num_tokens` share `src`'s pages, or None."""
        self._active(src)
        self._check_tokens(num_tokens)
        if slot is None:
            slot = self._best_idle_slot(key=lambda n: n)
            if slot is None:
                return None
        else:
            self._check_idle(slot)
        d = self._slots[slot]
        d.capacity, idle_since = num_tokens, d.idle_since
        shared = False
        try:
            shared = self.share_many({slot: src}, num_tokens)
        finally:
            if not shared:
                d.capacity, d.idle_since = 0, idle_since
        return slot if shared else None

    # ------------------------------------------------------------ swap

    def swap_out(self, slot: int) -> SwappedSlot:
        """Copy the slot's live bytes to host memory and give its pages back."""
        s = self._active(slot)
        src = self._read(slot, 0, max(s.written) * self.config.token_bytes)
        data = torch.empty(src.shape, dtype=torch.uint8, pin_memory=src.is_cuda)  # pinned: DMA both ways
        data.copy_(src)
        swapped = SwappedSlot(next(self._clock), data, s.capacity, tuple(s.written))
        self._cut(slot, 0)
        self._make_idle(s)
        self._swapped[swapped.key] = swapped
        return swapped

    def swap_in(self, swapped: SwappedSlot) -> int | None:
        """Restore a swapped-out slot (byte-exact) into a slot, or None if it does not fit."""
        self._check_swapped(swapped)
        slot = self.allocate(swapped.capacity)
        if slot is None:
            return None
        self._write(slot, 0, swapped.data)
        self._slots[slot].written = list(swapped.written)
        del self._swapped[swapped.key]
        return slot

    def discard(self, swapped: SwappedSlot) -> None:
        """Forget a swapped-out slot that will not come back (its request ended)."""
        self._check_swapped(swapped)
        del self._swapped[swapped.key]

    def _read(self, slot: int, start: int, nbytes: int) -> torch.Tensor:
        return self.storage.read(slot, self._slots[slot].pages, start, nbytes)

    def _write(self, slot: int, start: int, data: torch.Tensor) -> None:
        self.storage.write(slot, self._slots[slot].pages, start, data)

    def _check_swapped(self, swapped: SwappedSlot) -> None:
        if self._swapped.get(swapped.key) is not swapped:
            raise ValueError("this SwappedSlot was not swapped out of this cache, or was already swapped in")
