"""Slots and page groups: the bookkeeping every KV cache of vattn shares.

A slot is one request's region of `max_seq_len` tokens; page j of a slot in
every buffer is one *page group*, the unit the page pool counts.  A slot's
state is "page groups 0..n-1 present" (`_Slot.pages` is its block table).
Subclasses store the bytes: `VirtualKVCache` maps page groups into virtually
contiguous buffers, `PagedKVCache` keeps them in a block pool.

Deferred reclamation: a freed slot goes idle with its pages still held; the
next request takes the idle slot that best fits it, and idle pages (and what
a reused slot holds past its new size) are let go only when memory is short
(or on `trim`, `shrink`).  Idle slots hold private pages only, so every idle
page is reclaimable.

Sharing puts a page group into several slots (counted in the page pool).  Only
pages wholly inside the shared prefix are shared; the partly filled tail page
is copied, and writes are refused on shared pages, so no slot ever changes
another's tokens.
"""
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vattn.config import CacheConfig
from vattn.kv.pool import PagePool


@dataclass(slots=True)
class _Slot:
    written: list[int]  # tokens written, per layer
    pages: list[int] = field(default_factory=list)  # page group mapped at page j
    tokens: int = 0  # tokens the slot is sized for; 0 while idle
    shared_pages: int = 0  # pages[:shared_pages] may be shared; later pages are private
    idle_since: int = 0

    @property
    def active(self) -> bool:
        return self.tokens > 0


@dataclass(slots=True, frozen=True)
class SwappedSlot:
    """A slot's live bytes in host memory, from `swap_out`, for `swap_in`."""

    key: int
    data: torch.Tensor  # uint8 [num_buffers, live bytes]
    tokens: int
    written: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class CacheStats:
    pages_total: int  # physical pages in the budget
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
    map_calls: int
    unmap_calls: int


class SlotCache(ABC):
    """Slots over a pool of page groups; subclasses say where the bytes live
    (the hooks at the end: `_map`, `_unmap`, `_read_bytes`, `_write_bytes`,
    `_store`, `rows_kv`, `_release`, `_committed_bytes`)."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.pool = PagePool(config.num_page_groups)
        self._slots = [_Slot([0] * config.num_layers) for _ in range(config.max_batch)]
        self._clock = itertools.count(1)
        self._swapped: dict[int, SwappedSlot] = {}
        self.map_calls = self.unmap_calls = 0

    # ------------------------------------------------------------ slots

    def can_allocate(self, num_tokens: int, slot: int | None = None) -> bool:
        """Whether `allocate(num_tokens, slot)` would succeed; never raises."""
        try:
            return self._plan_allocation(num_tokens, slot, keep=0) is not None
        except ValueError:
            return False

    def allocate(self, num_tokens: int, slot: int | None = None, keep: int = 0) -> int | None:
        """A slot sized for `num_tokens`, or None when no slot or memory is left.

        Takes the idle slot whose mapped pages best fit the request (or the
        idle `slot` asked for), so a slot that already covers it needs no map
        call; reclaims other idle slots' pages if memory is short.  With
        `keep`, the idle `slot`'s first `keep` tokens, written by its previous
        owner and still mapped (see `retained`), count as written: a request
        with the same prefix resumes them (prefix caching).
        """
        plan = self._plan_allocation(num_tokens, slot, keep)
        if plan is None:
            return None
        slot, missing = plan
        self._make_room(missing, {slot: num_tokens})
        self._extend({slot: missing})
        s = self._slots[slot]
        s.tokens, s.written = num_tokens, [keep] * self.config.num_layers
        return slot

    def _plan_allocation(self, num_tokens: int, slot: int | None, keep: int) -> tuple[int, int] | None:
        self._check_tokens(num_tokens)
        need = self.config.pages_for(num_tokens)
        if slot is None:
            if keep:
                raise ValueError("keep needs the idle slot whose tokens are kept")
            slot = self._best_idle_slot(key=lambda n: (n < need, n if n >= need else -n))
            if slot is None:
                return None
        else:
            self._check_idle(slot)
            if not isinstance(keep, int) or not 0 <= keep <= min(num_tokens, self.retained(slot)):
                raise ValueError(f"keep={keep!r} must be an int in [0, {min(num_tokens, self.retained(slot))}]: "
                                 f"slot {slot} still maps {self.retained(slot)} tokens and is allocated for "
                                 f"{num_tokens}")
        missing = max(0, need - len(self._slots[slot].pages))
        return (slot, missing) if self._has_room(missing, {slot: num_tokens}) else None

    def retained(self, slot: int) -> int:
        """Tokens an idle slot's mapped pages still hold of what its last owner
        wrote, at most (idle pages are cut from the tail under pressure)."""
        self._check_idle(slot)
        return len(self._slots[slot].pages) * self.config.page_size // self.config.token_bytes

    def available_pages(self) -> int:
        """Page groups free or reclaimable (idle slots' pages, and what active
        slots hold past their size)."""
        return self.pool.num_free + sum(self._spare(i, {}) for i in range(len(self._slots)))

    def _best_idle_slot(self, key) -> int | None:
        """The idle slot whose mapped page count minimises `key`."""
        idle = [i for i, s in enumerate(self._slots) if not s.active]
        return min(idle, key=lambda i: key(len(self._slots[i].pages)), default=None)

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        """Whether `grow(slot, num_tokens)` would succeed; never raises."""
        try:
            growth, sizes = self._growth({slot: num_tokens})
        except ValueError:
            return False
        return self._has_room(sum(growth.values()), sizes)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Size `slot` for `num_tokens` (mapping what is missing); False if memory is short."""
        return self.grow_many({slot: num_tokens})

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
            s.tokens = max(s.tokens, num_tokens)
        return True

    def _growth(self, targets: Mapping[int, int]) -> tuple[dict[int, int], dict[int, int]]:
        """(page groups each slot lacks, the size each slot will have)."""
        growth, sizes = {}, {}
        for slot, num_tokens in targets.items():
            s = self._active(slot)
            self._check_tokens(num_tokens)
            growth[slot] = max(0, self.config.pages_for(num_tokens) - len(s.pages))
            sizes[slot] = max(s.tokens, num_tokens)
        return growth, sizes

    def free(self, slot: int) -> None:
        """Finish the slot's request.  Its private pages stay mapped (the slot
        goes idle) unless deferred reclamation is off; pages it shares with
        other slots are let go."""
        s = self._active(slot)
        first_shared = next((j for j in range(s.shared_pages) if self.pool.refs[s.pages[j]] > 1), len(s.pages))
        self._truncate(slot, first_shared if self.config.deferred_reclamation else 0)
        self._make_idle(s)

    def shrink(self, slots: Sequence[int]) -> int:
        """Unmap, in one call, each active slot's pages past those its size
        needs (a reused idle slot may hold more than its new request).
        Returns the page groups freed."""
        cuts = {slot: self.config.pages_for(self._active(slot).tokens) for slot in slots}
        freed = self._drop([(slot, j) for slot, keep in cuts.items() for j in range(keep, len(self._slots[slot].pages))])
        for slot, keep in cuts.items():
            del self._slots[slot].pages[keep:]
        return freed

    def trim(self) -> int:
        """Reclaim every idle page and give the memory of all free pages back
        where the storage can (the virtual cache's read as zeros when next
        used).  Returns the physical pages reclaimed from idle slots."""
        idle = sum(len(s.pages) for s in self._slots if not s.active)
        reclaimed = self._reclaim(idle, {})  # idle slots come first
        self._release(self.pool.free_pages())
        return reclaimed * self.config.num_buffers

    # ------------------------------------------------------------ sharing

    def share(self, src: int, dst: int, num_tokens: int) -> bool:
        """Make `dst` a slot of `num_tokens` tokens equal to the first
        `num_tokens` of `src` (see `share_many`)."""
        return self.share_many({dst: src}, num_tokens)

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
        drops = [(dst, j) for dst, k in kept.items() for j in range(k, len(self._slots[dst].pages))]
        refs = Counter(g for groups in taken.values() for g in groups)
        refs.subtract(self._slots[dst].pages[j] for dst, j in drops)
        freed = sum(1 for g, n in refs.items() if self.pool.refs[g] + n == 0)
        whole = {i: c.max_seq_len for i in set(sources) | set(sources.values())}  # these keep every page
        if not self._has_room(len(fresh_for) - freed, whole):
            return False

        start = full * c.page_size
        tails = {src: self._read_bytes(src, start, tail).clone() for src in set(sources.values())}
        self.pool.retain([g for groups in taken.values() for g in groups])  # before any source lets go
        self._drop(drops)
        for dst, k in kept.items():
            del self._slots[dst].pages[k:]
        self._make_room(len(fresh_for), whole)
        fresh = dict(zip(fresh_for, self.pool.allocate(len(fresh_for))))
        entries, groups = [], []
        for dst, k in kept.items():
            new = taken[dst] + ([fresh[dst]] if dst in fresh else [])
            entries += [(dst, j) for j in range(k, k + len(new))]
            groups += new
        self._attach(entries, groups)
        for dst, src in sources.items():
            self._write_bytes(dst, start, tails[src])
            b = self._slots[dst]
            b.tokens, b.written, b.shared_pages = num_tokens, [num_tokens] * c.num_layers, full
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
        d.tokens, idle_since = num_tokens, d.idle_since
        shared = False
        try:
            shared = self.share_many({slot: src}, num_tokens)
        finally:
            if not shared:
                d.tokens, d.idle_since = 0, idle_since
        return slot if shared else None

    # ------------------------------------------------------------ swap

    def swap_out(self, slot: int) -> SwappedSlot:
        """Copy the slot's live bytes to host memory and give its pages back."""
        s = self._active(slot)
        src = self._read_bytes(slot, 0, max(s.written) * self.config.token_bytes)
        data = torch.empty(src.shape, dtype=torch.uint8, pin_memory=src.is_cuda)  # pinned: DMA both ways
        data.copy_(src)
        swapped = SwappedSlot(next(self._clock), data, s.tokens, tuple(s.written))
        self._truncate(slot, 0)
        self._make_idle(s)
        self._swapped[swapped.key] = swapped
        return swapped

    def swap_in(self, swapped: SwappedSlot) -> int | None:
        """Restore a swapped-out slot (byte-exact) into a slot, or None if it does not fit."""
        self._check_swapped(swapped)
        slot = self.allocate(swapped.tokens)
        if slot is None:
            return None
        self._write_bytes(slot, 0, swapped.data)
        self._slots[slot].written = list(swapped.written)
        del self._swapped[swapped.key]
        return slot

    def discard(self, swapped: SwappedSlot) -> None:
        """Forget a swapped-out slot that will not come back (its request ended)."""
        self._check_swapped(swapped)
        del self._swapped[swapped.key]

    # ------------------------------------------------------------ data

    def write(self, layer: int, slots: Sequence[int], positions: Sequence[int],
              key: torch.Tensor, value: torch.Tensor, store: bool = True) -> None:
        """Store `key`/`value` `[B, T, H, D]` for `slots[i]` at tokens
        `positions[i] .. positions[i]+T-1` of `layer`.  A write may overwrite or
        extend what the slot holds, not leave a gap.  With `store=False` the
        write is checked and recorded but the bytes are left to the caller's
        kernel (FlashAttention appends K/V in place)."""
        c = self.config
        self._check_layer(layer)
        slots, positions = list(slots), list(positions)
        B = len(slots)
        if B == 0 or len(positions) != B:
            raise ValueError(f"write needs one position per slot, got {B} slots and {len(positions)} positions")
        if len(set(slots)) != B:
            raise ValueError(f"write got a slot twice: {slots}")
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != c.dtype or t.device != self.device:
                raise ValueError(f"{name} is {t.dtype} on {t.device}; the cache holds {c.dtype} on {self.device}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] == 0 or tuple(t.shape[2:]) != (c.num_kv_heads, c.head_dim):
                raise ValueError(f"{name} must be [{B}, T>0, {c.num_kv_heads}, {c.head_dim}], got {list(t.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} differ in shape")
        T = key.shape[1]
        for slot, pos in zip(slots, positions):
            s = self._active(slot)
            if not isinstance(pos, int) or not 0 <= pos <= s.written[layer]:
                raise ValueError(f"position {pos!r} for slot {slot} layer {layer} must be in "
                                 f"[0, {s.written[layer]}] (writes may not leave a gap)")
            if pos + T > s.tokens:
                raise ValueError(f"slot {slot} is sized for {s.tokens} tokens; writing {T} at {pos} "
                                 f"needs {pos + T}: grow it first")
            if pos * c.token_bytes // c.page_size < self._shared_prefix(s):
                raise ValueError(f"writing at token {pos} of slot {slot} would change a page it shares "
                                 f"with another slot")
        if store:
            self._store(layer, slots, positions, key, value)
        for slot, pos in zip(slots, positions):
            written = self._slots[slot].written
            written[layer] = max(written[layer], pos + T)

    def live_kv(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[written, H, D]` K and V of the tokens the slot has written in `layer`."""
        s = self._active(slot)
        self._check_layer(layer)
        k, v = self.rows_kv(layer, slot, slot + 1, s.written[layer])
        return k[0], v[0]

    def length(self, slot: int, layer: int | None = None) -> int:
        """Tokens written in `layer`, or in every layer."""
        written = self._active(slot).written
        if layer is None:
            return min(written)
        self._check_layer(layer)
        return written[layer]

    def capacity(self, slot: int) -> int:
        """Tokens the slot is sized for."""
        return self._active(slot).tokens

    def mapped_pages(self, slot: int) -> int:
        """Page groups mapped into the slot (it may be active or idle)."""
        self._check_slot(slot)
        return len(self._slots[slot].pages)

    @property
    def active_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.active]

    # ------------------------------------------------------------ stats

    def stats(self) -> CacheStats:
        c = self.config
        n = c.num_buffers
        live: dict[int, int] = {}  # page group -> live bytes in it, per buffer
        for s in self._slots:
            nbytes = max(s.written) * c.token_bytes
            for j, group in enumerate(s.pages[:c.pages_for(max(s.written))]):
                live[group] = max(live.get(group, 0), min(c.page_size, nbytes - j * c.page_size))
        mapped = self.pool.num_used * n * c.page_size
        live_bytes = sum(live.values()) * n
        return CacheStats(
            pages_total=self.pool.num_pages * n,
            pages_free=self.pool.num_free * n,
            pages_mapped=self.pool.num_used * n,
            pages_idle=sum(len(s.pages) for s in self._slots if not s.active) * n,
            pages_shared=self.pool.num_shared * n,
            mapped_bytes=mapped,
            live_bytes=live_bytes,
            utilization=live_bytes / mapped if mapped else 0.0,
            committed_bytes=self._committed_bytes(),
            active_slots=len(self.active_slots),
            swapped_slots=len(self._swapped),
            map_calls=self.map_calls,
            unmap_calls=self.unmap_calls,
        )

    def check(self) -> None:
        """Assert the bookkeeping is consistent: each page's reference count
        equals the slots that map it, free pages are mapped nowhere, idle slots
        hold only private pages, and active slots cover their size."""
        c = self.config
        mapped = Counter(g for s in self._slots for g in s.pages)
        free = self.pool.free_pages()
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert set(free).isdisjoint(mapped), "a free page is mapped"
        assert len(free) + len(mapped) == self.pool.num_pages, "a page is neither free nor mapped"
        for g, count in mapped.items():
            assert self.pool.refs[g] == count, f"page {g}: {self.pool.refs[g]} references, {count} mappings"
        for i, s in enumerate(self._slots):
            if s.active:
                assert len(s.pages) >= c.pages_for(s.tokens), f"slot {i} does not cover its {s.tokens} tokens"
                assert max(s.written) <= s.tokens, f"slot {i} has tokens written past its size"
            else:
                assert not any(s.written), f"idle slot {i} has tokens written"
                assert all(self.pool.refs[g] == 1 for g in s.pages), f"idle slot {i} holds a shared page"

    # ------------------------------------------------------------ pages

    def _spare(self, i: int, sizes: Mapping[int, int]) -> int:
        """Page groups slot i holds past what its size (`sizes[i]` if given)
        needs: all of an idle slot's, and what a reused slot brought along."""
        s = self._slots[i]
        return max(0, len(s.pages) - self.config.pages_for(sizes.get(i, s.tokens)))

    def _has_room(self, groups: int, sizes: Mapping[int, int]) -> bool:
        """Whether `groups` can be had from free and spare pages, the slots in
        `sizes` keeping what those sizes need."""
        free = self.pool.num_free
        return groups <= free or groups <= free + sum(self._spare(i, sizes) for i in range(len(self._slots)))

    def _make_room(self, groups: int, sizes: Mapping[int, int]) -> None:
        """Reclaim spare pages until `groups` are free (the caller checked `_has_room`)."""
        deficit = groups - self.pool.num_free
        if deficit > 0:
            self._reclaim(deficit, sizes)

    def _reclaim(self, groups: int, sizes: Mapping[int, int]) -> int:
        """Unmap up to `groups` spare page groups, each slot's from its tail:
        idle slots first, least recently idle first, then what active slots
        hold past their size.  Returns the groups freed."""
        order = sorted((s.active, s.idle_since, i) for i, s in enumerate(self._slots) if self._spare(i, sizes))
        cuts = {}
        for _, _, i in order:
            if groups <= 0:
                break
            take = min(groups, self._spare(i, sizes))
            cuts[i] = len(self._slots[i].pages) - take
            groups -= take
        drops = [(i, j) for i, keep in cuts.items() for j in range(keep, len(self._slots[i].pages))]
        freed = self._drop(drops)
        for i, keep in cuts.items():
            del self._slots[i].pages[keep:]
        return freed

    def _extend(self, growth: Mapping[int, int]) -> None:
        """Map `growth[slot]` fresh page groups after each slot's last page."""
        groups = self.pool.allocate(sum(growth.values()))
        assert groups is not None, "room was checked"
        if not groups:
            return
        self._attach([(i, j) for i, n in growth.items()
                      for j in range(len(self._slots[i].pages), len(self._slots[i].pages) + n)], groups)

    def _attach(self, entries: list[tuple[int, int]], groups: list[int]) -> None:
        """Map allocated `groups` at (slot, page index) `entries`, each after its
        slot's last page; if mapping fails, the groups go back to the pool."""
        try:
            self._map(entries, groups)
        except BaseException:
            self.pool.release(groups)
            raise
        for (i, _), group in zip(entries, groups):
            self._slots[i].pages.append(group)

    def _truncate(self, slot: int, keep: int) -> None:
        s = self._slots[slot]
        self._drop([(slot, j) for j in range(keep, len(s.pages))])
        del s.pages[keep:]

    def _drop(self, entries: list[tuple[int, int]]) -> int:
        """Take (slot, page index) entries out of their slots and drop their
        references.  Returns the groups freed (back on the free list; `trim`
        gives their memory back)."""
        if not entries:
            return 0
        groups = [self._slots[i].pages[j] for i, j in entries]
        self._unmap(entries)
        return len(self.pool.release(groups))

    def _shared_prefix(self, s: _Slot) -> int:
        """Pages before this index may be shared; from it on all are private."""
        while s.shared_pages and self.pool.refs[s.pages[s.shared_pages - 1]] == 1:
            s.shared_pages -= 1
        return s.shared_pages

    def _make_idle(self, s: _Slot) -> None:
        s.tokens = s.shared_pages = 0
        s.written = [0] * self.config.num_layers
        s.idle_since = next(self._clock)

    # ------------------------------------------------------------ storage

    @abstractmethod
    def _map(self, entries: list[tuple[int, int]], groups: list[int]) -> None:
        """Put page group `groups[i]` at (slot, page index) `entries[i]`; all or nothing."""

    @abstractmethod
    def _unmap(self, entries: list[tuple[int, int]]) -> None:
        """Take the page groups at (slot, page index) `entries` away."""

    @abstractmethod
    def _read_bytes(self, slot: int, start: int, nbytes: int) -> torch.Tensor:
        """`[num_buffers, nbytes]` of the slot from byte `start`, in every buffer."""

    @abstractmethod
    def _write_bytes(self, slot: int, start: int, data: torch.Tensor) -> None:
        """Put `[num_buffers, n]` bytes into the slot from byte `start`."""

    @abstractmethod
    def _store(self, layer: int, slots: list[int], positions: list[int], key: torch.Tensor,
               value: torch.Tensor) -> None:
        """Put checked `[B, T, H, D]` K/V at each slot's positions."""

    @abstractmethod
    def rows_kv(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[hi - lo, length, H, D]` of `layer`: the first `length`
        tokens of slots lo..hi-1, for kernels given each slot's length.  Where
        `readable(lo, hi, length)`, every row is safe to read: past a slot's
        length it holds zeros or finite stale values; elsewhere read only
        each slot's own rows."""

    def readable(self, lo: int, hi: int, length: int) -> bool:
        """Whether all `length` rows of slots lo..hi-1 may be read."""
        return True

    def _release(self, groups: list[int]) -> None:
        """Give the memory of free page groups back, where the storage can."""

    @abstractmethod
    def _committed_bytes(self) -> int:
        """Physical memory the storage holds now."""

    # ------------------------------------------------------------ checks

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.config.max_batch:
            raise ValueError(f"slot {slot!r} does not exist (max_batch={self.config.max_batch})")

    def _active(self, slot: int) -> _Slot:
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
        if not _valid_tokens(num_tokens, self.config.max_seq_len):
            raise ValueError(f"token count must be an int in [1, max_seq_len={self.config.max_seq_len}], "
                             f"got {num_tokens!r}")

    def _check_swapped(self, swapped: SwappedSlot) -> None:
        if self._swapped.get(swapped.key) is not swapped:
            raise ValueError("this SwappedSlot was not swapped out of this cache, or was already swapped in")

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer!r} does not exist (num_layers={self.config.num_layers})")


def _valid_tokens(n, max_seq_len: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= max_seq_len

