"""Slots and pages: the bookkeeping every KV cache of vattn shares.

A slot is one request's region of `max_seq_len` tokens; a *page* is page j of
a slot in every buffer, the unit the page pool counts.  A slot's state is
"pages 0..n-1 present" (`Slot.pages` is its block table).  A storage
(`vattn.kv.storage`) puts the bytes where the pages say.

Deferred reclamation: a freed slot goes idle with its pages still held; the
next request takes the idle slot that best fits it, and idle pages (and what
a reused slot holds past its new capacity) are let go only when memory is
short (or on `trim`, `shrink`).  Idle slots hold private pages only, so every
idle page is reclaimable.

The process's limit on mappings (`MapLimitError`) is met here: idle pages are
unmapped and the call tried once more, and if it still fails the operation
reports memory as short (False / None), counted in `map_limit_hits`.
"""
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vattn.backends import MapLimitError
from vattn.config import CacheConfig
from vattn.kv.access import Access
from vattn.kv.inspect import Inspection
from vattn.kv.pool import PagePool
from vattn.kv.sharing import Sharing, SwappedSlot
from vattn.kv.storage import Storage, short_at_map_limit

__all__ = ["Slot", "SlotCache", "SwappedSlot"]


@dataclass(slots=True)
class Slot:
    written: list[int]  # tokens written, per layer
    pages: list[int] = field(default_factory=list)  # the page at each page index
    capacity: int = 0  # tokens the slot is sized for; 0 while idle
    shared_pages: int = 0  # pages[:shared_pages] may be shared; later pages are private
    idle_since: int = 0

    @property
    def active(self) -> bool:
        return self.capacity > 0


class SlotCache(Access, Sharing, Inspection):
    """Slots over a pool of pages, the bytes in `storage`."""

    kind: str  # "virtual" or "paged": how kernels reach the K/V (`vattn.attention.registry`)

    def __init__(self, config: CacheConfig, storage: Storage):
        self.config, self.storage, self.device = config, storage, storage.device
        self.pool = PagePool(config.num_pages)
        self._slots = [Slot([0] * config.num_layers) for _ in range(config.max_num_seqs)]
        self._clock = itertools.count(1)
        self._swapped: dict[int, SwappedSlot] = {}
        self._zero_filled: set[tuple[int, int]] = set()  # (slot, page index) where the zero page is mapped
        self._readable_range: tuple[int, int, int] | None = None  # (lo, hi, pages) filled, until the next (un)map
        self.map_calls = self.unmap_calls = self.map_limit_hits = 0

    # ------------------------------------------------------------ slots

    def can_allocate(self, num_tokens: int, slot: int | None = None) -> bool:
        """Whether `allocate(num_tokens, slot)` would find room; never raises."""
        try:
            return self._plan_allocation(num_tokens, slot, resume=0) is not None
        except ValueError:
            return False

    @short_at_map_limit(None)
    def allocate(self, num_tokens: int, slot: int | None = None, resume: int = 0) -> int | None:
        """A slot sized for `num_tokens`, or None when no slot or memory is left.

        Takes the idle slot whose mapped pages best fit the request (or the
        idle `slot` asked for), so a slot that already covers it needs no map
        call; reclaims other idle slots' pages if memory is short.  With
        `resume`, the idle `slot`'s first `resume` tokens, written by its
        previous owner and still mapped (see `retained`), count as written: a
        request with the same prefix resumes them (prefix caching).
        """
        plan = self._plan_allocation(num_tokens, slot, resume)
        if plan is None:
            return None
        slot, missing = plan
        self._make_room(missing, {slot: num_tokens})
        self._extend({slot: missing})
        s = self._slots[slot]
        self.pool.forget(s.pages[resume * self.config.token_bytes // self.config.page_size:])  # to be overwritten
        s.capacity, s.written = num_tokens, [resume] * self.config.num_layers
        return slot

    def _plan_allocation(self, num_tokens: int, slot: int | None, resume: int) -> tuple[int, int] | None:
        self._check_tokens(num_tokens)
        need = self.config.pages_for(num_tokens)
        if slot is None:
            if resume:
                raise ValueError("resume needs the idle slot whose tokens are resumed")
            slot = self._best_idle_slot(key=lambda n: (n < need, n if n >= need else -n))
            if slot is None:
                return None
        else:
            self._check_idle(slot)
            most = min(num_tokens, self.retained(slot))
            if not isinstance(resume, int) or not 0 <= resume <= most:
                raise ValueError(f"resume={resume!r} must be an int in [0, {most}]: slot {slot} still maps "
                                 f"{self.retained(slot)} tokens and is allocated for {num_tokens}")
        missing = max(0, need - len(self._slots[slot].pages))
        return (slot, missing) if self._has_room(missing, {slot: num_tokens}) else None

    def retained(self, slot: int) -> int:
        """Tokens an idle slot's mapped pages still hold of what its last owner
        wrote, at most (idle pages are cut from the tail under pressure)."""
        self._check_idle(slot)
        return self.config.tokens_in(len(self._slots[slot].pages))

    def available_pages(self) -> int:
        """Pages free or reclaimable (idle slots' pages, and what active slots
        hold past their capacity)."""
        return self.pool.num_free + sum(self._spare(i, {}) for i in range(len(self._slots)))

    def _best_idle_slot(self, key) -> int | None:
        """The idle slot whose mapped page count minimises `key`."""
        idle = [i for i, s in enumerate(self._slots) if not s.active]
        return min(idle, key=lambda i: key(len(self._slots[i].pages)), default=None)

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        """Whether `grow(slot, num_tokens)` would find room; never raises."""
        try:
            growth, sizes = self._growth({slot: num_tokens})
        except ValueError:
            return False
        return self._has_room(sum(growth.values()), sizes)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Size `slot` for `num_tokens` (mapping what is missing); False if memory is short."""
        return self.grow_many({slot: num_tokens})

    @short_at_map_limit(False)
    def grow_many(self, targets: Mapping[int, int]) -> bool:
        """Grow several slots with one batched map call; all or nothing."""
        growth, sizes = self._growth(targets)
        needed = sum(growth.values())
        if needed:
            if not self._has_room(needed, sizes):
                return False
            self._make_room(needed, sizes)
            self._extend(growth)
        for slot, num_tokens in targets.items():
            s = self._slots[slot]
            s.capacity = max(s.capacity, num_tokens)
        return True

    def _growth(self, targets: Mapping[int, int]) -> tuple[dict[int, int], dict[int, int]]:
        """(pages each slot lacks, the capacity each slot will have)."""
        growth, sizes = {}, {}
        for slot, num_tokens in targets.items():
            s = self._active(slot)
            self._check_tokens(num_tokens)
            growth[slot] = max(0, self.config.pages_for(num_tokens) - len(s.pages))
            sizes[slot] = max(s.capacity, num_tokens)
        return growth, sizes

    def free(self, slot: int, keep: bool = True) -> None:
        """Finish the slot's request.  Its private pages stay mapped (the slot
        goes idle) if `keep` and deferred reclamation is on; pages it shares
        with other slots are let go."""
        s = self._active(slot)
        first_shared = next((j for j in range(s.shared_pages) if self.pool.refs[s.pages[j]] > 1), len(s.pages))
        self._cut(slot, first_shared if keep and self.config.deferred_reclamation else 0)
        self._make_idle(s)

    def shrink(self, slots: Sequence[int]) -> int:
        """Unmap, in one call, each active slot's pages past those its capacity
        needs (a reused idle slot may hold more than its new request).
        Returns the pages freed."""
        cuts = {slot: self.config.pages_for(self._active(slot).capacity) for slot in slots}
        return self._cut_many(cuts)

    def trim(self) -> int:
        """Reclaim every idle page and give the memory of all free pages back
        where the storage can (the virtual cache's read as zeros when next
        used).  Returns the pages reclaimed from idle slots."""
        idle = sum(len(s.pages) for s in self._slots if not s.active)
        reclaimed = self._reclaim(idle, {})  # idle slots come first
        self.storage.release(self.pool.free_pages())
        return reclaimed

    # ------------------------------------------------------------ state

    def length(self, slot: int, layer: int | None = None) -> int:
        """Tokens written in `layer`, or in every layer."""
        written = self._active(slot).written
        if layer is None:
            return min(written)
        self._check_layer(layer)
        return written[layer]

    def capacity(self, slot: int) -> int:
        """Tokens the slot is sized for."""
        return self._active(slot).capacity

    def mapped_pages(self, slot: int) -> int:
        """Pages mapped into the slot (it may be active or idle)."""
        self._check_slot(slot)
        return len(self._slots[slot].pages)

    def block_table(self, slot: int) -> list[int]:
        """The slot's pages, in token order."""
        self._check_slot(slot)
        return list(self._slots[slot].pages)

    @property
    def active_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.active]

    # ------------------------------------------------------------ pages

    def _spare(self, i: int, sizes: Mapping[int, int]) -> int:
        """Pages slot i holds past what its capacity (`sizes[i]` if given)
        needs: all of an idle slot's, and what a reused slot brought along."""
        s = self._slots[i]
        return max(0, len(s.pages) - self.config.pages_for(sizes.get(i, s.capacity)))

    def _has_room(self, pages: int, sizes: Mapping[int, int]) -> bool:
        """Whether `pages` can be had from free and spare pages, the slots in
        `sizes` keeping what those capacities need."""
        free = self.pool.num_free
        return pages <= free or pages <= free + sum(self._spare(i, sizes) for i in range(len(self._slots)))

    def _make_room(self, pages: int, sizes: Mapping[int, int]) -> None:
        """Reclaim spare pages until `pages` are free (the caller checked `_has_room`)."""
        deficit = pages - self.pool.num_free
        if deficit > 0:
            self._reclaim(deficit, sizes)

    def _reclaim(self, pages: int, sizes: Mapping[int, int]) -> int:
        """Unmap up to `pages` spare pages, each slot's from its tail: idle
        slots first, least recently idle first, then what active slots hold
        past their capacity.  Returns the pages freed."""
        order = sorted((s.active, s.idle_since, i) for i, s in enumerate(self._slots) if self._spare(i, sizes))
        cuts = {}
        for _, _, i in order:
            if pages <= 0:
                break
            take = min(pages, self._spare(i, sizes))
            cuts[i] = len(self._slots[i].pages) - take
            pages -= take
        return self._cut_many(cuts)

    def _extend(self, growth: Mapping[int, int]) -> None:
        """Map `growth[slot]` fresh pages after each slot's last page."""
        pages = self.pool.allocate(sum(growth.values()))
        assert pages is not None, "room was checked"
        if pages:
            self._attach([(i, j) for i, n in growth.items()
                          for j in range(len(self._slots[i].pages), len(self._slots[i].pages) + n)], pages)

    def _attach(self, entries: list[tuple[int, int]], pages: list[int]) -> None:
        """Map allocated `pages` at (slot, page index) `entries`, each after its
        slot's last page, taking the zero page away first where it is mapped
        there; if mapping fails, the pages go back to the pool.  At the mapping
        limit, idle slots' pages (which hold mapping entries too) are unmapped
        and the call tried once more."""
        self._readable_range = None
        filled = [e for e in entries if e in self._zero_filled]
        if filled:
            self.storage.unmap(filled)
            self._zero_filled.difference_update(filled)
        try:
            try:
                self.storage.map(entries, pages)
            except MapLimitError:
                idle = sum(len(s.pages) for s in self._slots if not s.active)
                if not idle:
                    raise
                self._reclaim(idle, {})  # idle slots come first, so only they are cut
                self.storage.map(entries, pages)
        except BaseException:
            self.pool.release(pages)
            raise
        self.map_calls += 1
        for (i, _), page in zip(entries, pages):
            self._slots[i].pages.append(page)

    def _cut(self, slot: int, keep: int) -> int:
        return self._cut_many({slot: keep})

    def _cut_many(self, cuts: Mapping[int, int]) -> int:
        """Let go each slot's pages from index `cuts[slot]` on, in one unmap
        call.  Returns the pages freed (back on the free list; `trim` gives
        their memory back)."""
        entries = [(i, j) for i, keep in cuts.items() for j in range(keep, len(self._slots[i].pages))]
        if not entries:
            return 0
        pages = [self._slots[i].pages[j] for i, j in entries]
        self._readable_range = None
        self.storage.unmap(entries)
        self.unmap_calls += 1
        for i, keep in cuts.items():
            del self._slots[i].pages[keep:]
        return len(self.pool.release(pages))

    def _shared_prefix(self, s: Slot) -> int:
        """Pages before this index may be shared; from it on all are private."""
        while s.shared_pages and self.pool.refs[s.pages[s.shared_pages - 1]] == 1:
            s.shared_pages -= 1
        return s.shared_pages

    def _make_idle(self, s: Slot) -> None:
        s.capacity = s.shared_pages = 0
        s.written = [0] * self.config.num_layers
        s.idle_since = next(self._clock)

    # ------------------------------------------------------------ checks

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.config.max_num_seqs:
            raise ValueError(f"slot {slot!r} does not exist (max_num_seqs={self.config.max_num_seqs})")

    def _active(self, slot: int) -> Slot:
        self._check_slot(slot)
        s = self._slots[slot]
        if not s.active:
            raise ValueError(f"slot {slot} is not allocated (it is free or was freed)")
        return s

    def _check_idle(self, slot: int) -> None:
        self._check_slot(slot)
        if self._slots[slot].active:
            raise ValueError(f"slot {slot} is already allocated")

    def _check_tokens(self, num_tokens: int) -> None:
        n = num_tokens
        if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.config.max_seq_len):
            raise ValueError(f"token count must be an int in [1, max_seq_len={self.config.max_seq_len}], "
                             f"got {num_tokens!r}")

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer!r} does not exist (num_layers={self.config.num_layers})")
