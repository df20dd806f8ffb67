"""The KV cache's bookkeeping: slots given out, grown, shared, swapped and let go.

`SlotCache` is the cache a scheduler's manager (`vattn.kv.manager`) drives:
its slots and pages live in a `SlotTable` (`vattn.kv.table`), its bytes in a
storage, and what the forward reads and writes goes through its data plane,
`data` (`vattn.kv.data`).

Deferred reclamation: a freed slot goes idle with its pages still held; the
next request takes the idle slot that best fits it, and idle pages (and what
a reused slot holds past its new capacity) are let go only when memory is
short (or on `trim`, `shrink`).  Idle slots hold private pages only, so every
idle page is reclaimable.

The process's limit on mappings is met here: an operation that still fails
at it reports memory as short (False / None), counted in `map_limit_hits`.
"""
from collections.abc import Mapping, Sequence

import vattn.kv.sharing as sharing
import vattn.kv.stats as stats
from vattn.config import CacheConfig
from vattn.kv.data import KVData
from vattn.kv.sharing import SwappedSlot
from vattn.kv.storage import Storage
from vattn.kv.table import SlotTable, short_at_map_limit


class SlotCache:
    """Slots over a pool of pages, the bytes in `storage`."""

    kind: str  # "virtual" or "paged": how kernels reach the K/V (`vattn.attention.registry`)

    def __init__(self, config: CacheConfig, storage: Storage, member=None):
        self.config, self.storage, self.device = config, storage, storage.device
        self.table = SlotTable(config, storage, member)
        self.pool = self.table.pool
        self.data = KVData(self.table, self.kind)
        self._swapped: dict[int, SwappedSlot] = {}  # out of this cache, by stamp

    @property
    def map_calls(self) -> int:
        """Batched calls that put pages into slots."""
        return self.table.map_calls

    @property
    def unmap_calls(self) -> int:
        return self.table.unmap_calls

    @property
    def map_limit_hits(self) -> int:
        """Operations answered "no room" at the process's limit on mappings."""
        return self.table.map_limit_hits

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
        self.table.make_room(missing, {slot: num_tokens})
        self.table.extend({slot: missing})
        s = self.table.slots[slot]
        self.pool.forget(s.pages[resume * self.config.token_bytes // self.config.page_size:])  # to be overwritten
        s.capacity, s.written = num_tokens, [resume] * self.config.num_layers
        return slot

    def _plan_allocation(self, num_tokens: int, slot: int | None, resume: int) -> tuple[int, int] | None:
        self.table.check_tokens(num_tokens)
        need = self.config.pages_for(num_tokens)
        if slot is None:
            if resume:
                raise ValueError("resume needs the idle slot whose tokens are resumed")
            slot = self.table.best_idle(key=lambda n: (n < need, n if n >= need else -n))
            if slot is None:
                return None
        else:
            self.table.idle(slot)
            most = min(num_tokens, self.retained(slot))
            if not isinstance(resume, int) or not 0 <= resume <= most:
                raise ValueError(f"resume={resume!r} must be an int in [0, {most}]: slot {slot} still maps "
                                 f"{self.retained(slot)} tokens and is allocated for {num_tokens}")
        missing = max(0, need - len(self.table.slots[slot].pages))
        return (slot, missing) if self.table.has_room(missing, {slot: num_tokens}) else None

    def retained(self, slot: int) -> int:
        """Tokens an idle slot's mapped pages still hold of what its last owner
        wrote, at most (idle pages are cut from the tail under pressure)."""
        self.table.idle(slot)
        return self.config.tokens_in(len(self.table.slots[slot].pages))

    def available_pages(self) -> int:
        """Pages free or reclaimable (idle slots' pages, and what active slots
        hold past their capacity), and those a shared pool's member could obtain."""
        t = self.table
        obtainable = t.member.obtainable() if t.member is not None else 0
        return self.pool.num_free + sum(t.spare(i, {}) for i in range(len(t.slots))) + obtainable

    def can_grow(self, slot: int, num_tokens: int) -> bool:
        """Whether `grow(slot, num_tokens)` would find room; never raises."""
        try:
            growth, sizes = self._growth({slot: num_tokens})
        except ValueError:
            return False
        return self.table.has_room(sum(growth.values()), sizes)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Size `slot` for `num_tokens` (mapping what is missing); False if memory is short."""
        return self.grow_many({slot: num_tokens})

    @short_at_map_limit(False)
    def grow_many(self, targets: Mapping[int, int]) -> bool:
        """Grow several slots with one batched map call; all or nothing."""
        growth, sizes = self._growth(targets)
        needed = sum(growth.values())
        if needed:
            if not self.table.has_room(needed, sizes):
                return False
            self.table.make_room(needed, sizes)
            self.table.extend(growth)
        for slot, num_tokens in targets.items():
            s = self.table.slots[slot]
            s.capacity = max(s.capacity, num_tokens)
        return True

    def _growth(self, targets: Mapping[int, int]) -> tuple[dict[int, int], dict[int, int]]:
        """(pages each slot lacks, the capacity each slot will have)."""
        growth, sizes = {}, {}
        for slot, num_tokens in targets.items():
            s = self.table.active(slot)
            self.table.check_tokens(num_tokens)
            growth[slot] = max(0, self.config.pages_for(num_tokens) - len(s.pages))
            sizes[slot] = max(s.capacity, num_tokens)
        return growth, sizes

    def free(self, slot: int, keep: bool = True) -> None:
        """Finish the slot's request.  Its private pages stay mapped (the slot
        goes idle) if `keep` and deferred reclamation is on; pages it shares
        with other slots are let go."""
        s = self.table.active(slot)
        first_shared = next((j for j in range(s.shared_pages) if self.pool.refs[s.pages[j]] > 1), len(s.pages))
        self.table.cut({slot: first_shared if keep and self.config.deferred_reclamation else 0})
        self.table.make_idle(s)

    def shrink(self, slots: Sequence[int]) -> int:
        """Unmap, in one call, each active slot's pages past those its capacity
        needs (a reused idle slot may hold more than its new request).
        Returns the pages freed."""
        cuts = {slot: self.config.pages_for(self.table.active(slot).capacity) for slot in slots}
        return self.table.cut(cuts)

    def trim(self) -> int:
        """Reclaim every idle page and give the memory of all free pages back
        where the storage can (the virtual cache's read as zeros when next
        used); a shared pool's member gives its free chunks above its floor back.
        Returns the pages reclaimed from idle slots."""
        idle = sum(len(s.pages) for s in self.table.slots if not s.active)
        reclaimed = self.table.reclaim(idle, {})  # idle slots come first
        self.table.release_free()
        if self.table.member is not None:
            self.table.member.give_back()
        return reclaimed

    # ------------------------------------------------------------ state

    def length(self, slot: int, layer: int | None = None) -> int:
        """Tokens written in `layer`, or in every layer."""
        written = self.table.active(slot).written
        if layer is None:
            return min(written)
        self.table.check_layer(layer)
        return written[layer]

    def capacity(self, slot: int) -> int:
        """Tokens the slot is sized for."""
        return self.table.active(slot).capacity

    def mapped_pages(self, slot: int) -> int:
        """Pages mapped into the slot (it may be active or idle)."""
        return len(self.table.slot(slot).pages)

    def block_table(self, slot: int) -> list[int]:
        """The slot's pages, in token order."""
        return list(self.table.slot(slot).pages)

    @property
    def active_slots(self) -> list[int]:
        return [i for i, s in enumerate(self.table.slots) if s.active]

    # ------------------------------------------------------------ sharing and swap (`vattn.kv.sharing`)

    @short_at_map_limit(False)
    def share_many(self, sources: Mapping[int, int], num_tokens: int) -> bool:
        """Make each slot `dst` in `sources` a slot of `num_tokens` tokens equal
        to the first `num_tokens` of `sources[dst]` as it was before the call
        (so slots may trade contents, as beams do).  Full pages are mapped into
        `dst` (shared), the partly filled tail page is copied into a private
        page, and `dst`'s other pages are let go.  With `dst == src` the slot
        is cut to `num_tokens`.  False (nothing changed) if memory is short."""
        return sharing.share(self.table, sources, num_tokens)

    def share(self, src: int, dst: int, num_tokens: int) -> bool:
        """Make `dst` a slot of `num_tokens` tokens equal to the first
        `num_tokens` of `src` (see `share_many`)."""
        return self.share_many({dst: src}, num_tokens)

    def truncate(self, slot: int, num_tokens: int) -> bool:
        """Cut the slot to its first `num_tokens` tokens."""
        return self.share_many({slot: slot}, num_tokens)

    def fork(self, src: int, num_tokens: int, slot: int | None = None) -> int | None:
        """A new slot (the idle `slot` asked for, or the idle slot holding the
        fewest pages) whose first `num_tokens` share `src`'s pages, or None."""
        t = self.table
        t.active(src)
        t.check_tokens(num_tokens)
        if slot is None:
            slot = t.best_idle(key=lambda n: n)
            if slot is None:
                return None
        d = t.idle(slot)
        d.capacity, idle_since = num_tokens, d.idle_since
        shared = False
        try:
            shared = self.share_many({slot: src}, num_tokens)
        finally:
            if not shared:
                d.capacity, d.idle_since = 0, idle_since
        return slot if shared else None

    def swap_out(self, slot: int) -> SwappedSlot:
        """Copy the slot's live bytes to host memory and give its pages back."""
        swapped = sharing.swap_out(self.table, slot)
        self._swapped[swapped.key] = swapped
        return swapped

    def swap_in(self, swapped: SwappedSlot) -> int | None:
        """Restore a swapped-out slot (byte-exact) into a slot, or None if it does not fit."""
        self._check_swapped(swapped)
        slot = self.allocate(swapped.capacity)
        if slot is None:
            return None
        sharing.restore(self.table, slot, swapped)
        del self._swapped[swapped.key]
        return slot

    def discard(self, swapped: SwappedSlot) -> None:
        """Forget a swapped-out slot that will not come back (its request ended)."""
        self._check_swapped(swapped)
        del self._swapped[swapped.key]

    def _check_swapped(self, swapped: SwappedSlot) -> None:
        if self._swapped.get(swapped.key) is not swapped:
            raise ValueError("this SwappedSlot was not swapped out of this cache, or was already swapped in")

    # ------------------------------------------------------------ what it can say of itself (`vattn.kv.stats`)

    def stats(self) -> stats.CacheStats:
        return stats.of(self.table, swapped=len(self._swapped))

    def check(self) -> None:
        """Assert the bookkeeping is consistent (`vattn.kv.stats.check`)."""
        stats.check(self.table)
