"""The slot table: every slot's pages, and the moves that map and unmap them.

A slot is one request's region of `max_seq_len` tokens; a *page* is page j of
a slot in every buffer, the unit the page pool counts.  A slot's state is
"pages 0..n-1 present" (`Slot.pages` is its block table).  A storage
(`vattn.kv.storage`) puts the bytes where the pages say.

This is the mechanism the cache's parts share (`SlotCache`'s allocation,
`vattn.kv.sharing`, `KVData`, `vattn.kv.stats`): the records, the checks, and
page moves that keep the pool, the storage and the records in step.  What
goes where is decided by those parts.

The process's limit on mappings (`MapLimitError`) is met in `attach`: idle
pages are unmapped and the call tried once more; an unmap there counts its
pages let go even where a run could not be unmapped (`_unmap`).  The entries
a slot's pages take are drawn from the process's budget before they are
mapped (`vattn.backends.map_entries`), so a cache meets its share of the
limit, not the OS's.

A table over a shared pool (`vattn.kv.shared`) draws its pages from its
`member`: it holds only some of its pool's pages, comes to hold more when
short (`make_room`), and gives chunks up when another member asks.
"""
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from vattn.backends import MapLimitError
from vattn.checks import is_int
from vattn.config import CacheConfig
from vattn.kv.pool import PagePool
from vattn.kv.storage import Storage


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


class SlotTable:
    """The slots over a pool of pages, the bytes in `storage`."""

    def __init__(self, config: CacheConfig, storage: Storage, member=None):
        self.config, self.storage, self.member = config, storage, member
        if member is None:
            self.pool, self.run = PagePool(config.num_pages), 0
        else:
            member.bind(self, config.page_bytes, config.page_size)
            self.pool, self.run = PagePool(member.num_pages, held=False, spread=False), member.per_chunk
        self.slots = [Slot([0] * config.num_layers) for _ in range(config.max_num_seqs)]
        self.clock = itertools.count(1)  # stamps: when a slot went idle, which swap-out a SwappedSlot is
        self.zero_filled: set[tuple[int, int]] = set()  # (slot, page index) where the zero page is mapped
        self.readable_range: tuple[int, int, int] | None = None  # (lo, hi, pages) filled, until the next (un)map
        self.map_calls = self.unmap_calls = self.map_limit_hits = 0
        self.entries = 0  # mapping entries the slots' pages take in each buffer (`entries`), drawn from the budget

    # ------------------------------------------------------------ checks

    def slot(self, i: int) -> Slot:
        if not is_int(i) or not 0 <= i < self.config.max_num_seqs:
            raise ValueError(f"slot {i!r} does not exist (max_num_seqs={self.config.max_num_seqs})")
        return self.slots[i]

    def active(self, i: int) -> Slot:
        s = self.slot(i)
        if not s.active:
            raise ValueError(f"slot {i} is not allocated (it is free or was freed)")
        return s

    def idle(self, i: int) -> Slot:
        s = self.slot(i)
        if s.active:
            raise ValueError(f"slot {i} is already allocated")
        return s

    def check_tokens(self, num_tokens: int) -> None:
        if not (is_int(num_tokens) and 1 <= num_tokens <= self.config.max_seq_len):
            raise ValueError(f"token count must be an int in [1, max_seq_len={self.config.max_seq_len}], "
                             f"got {num_tokens!r}")

    def check_layer(self, layer: int) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer!r} does not exist (num_layers={self.config.num_layers})")

    # ------------------------------------------------------------ room

    def spare(self, i: int, sizes: Mapping[int, int]) -> int:
        """Pages slot i holds past what its capacity (`sizes[i]` if given)
        needs: all of an idle slot's, and what a reused slot brought along."""
        s = self.slots[i]
        return max(0, len(s.pages) - self.config.pages_for(sizes.get(i, s.capacity)))

    @property
    def most_pages(self) -> int:
        """Pages the table could ever hold."""
        return self.pool.num_pages if self.member is None else self.member.most_pages()

    def has_room(self, pages: int, sizes: Mapping[int, int]) -> bool:
        """Whether `pages` can be had from free and spare pages (and what the
        member could obtain), the slots in `sizes` keeping what those
        capacities need."""
        free = self.pool.num_free
        if pages <= free:
            return True
        free += sum(self.spare(i, sizes) for i in range(len(self.slots)))
        return pages <= free or (self.member is not None and pages <= free + self.member.obtainable())

    def make_room(self, pages: int, sizes: Mapping[int, int]) -> None:
        """Make `pages` free (the caller checked `has_room`): the member's
        free chunks first, then this table's spare pages, then the other
        members' idle chunks."""
        if pages > self.pool.num_free and self.member is not None:
            self.member.take_free(pages - self.pool.num_free)
        if pages > self.pool.num_free:
            self.reclaim(pages - self.pool.num_free, sizes)
        if pages > self.pool.num_free and self.member is not None:
            self.member.take_idle(pages - self.pool.num_free)

    def reclaim(self, pages: int, sizes: Mapping[int, int]) -> int:
        """Unmap up to `pages` spare pages, each slot's from its tail: idle
        slots first, least recently idle first, then what active slots hold
        past their capacity.  Returns the pages freed."""
        order = sorted((s.active, s.idle_since, i) for i, s in enumerate(self.slots) if self.spare(i, sizes))
        cuts = {}
        for _, _, i in order:
            if pages <= 0:
                break
            take = min(pages, self.spare(i, sizes))
            cuts[i] = len(self.slots[i].pages) - take
            pages -= take
        return self.cut(cuts)

    def best_idle(self, key) -> int | None:
        """The idle slot whose mapped page count minimises `key`."""
        idle = [i for i, s in enumerate(self.slots) if not s.active]
        return min(idle, key=lambda i: key(len(self.slots[i].pages)), default=None)

    # ------------------------------------------------------------ page moves

    def extend(self, growth: Mapping[int, int]) -> None:
        """Map `growth[slot]` fresh pages after each slot's last page."""
        assert sum(growth.values()) <= self.pool.num_free, "room was checked"
        entries, pages = [], []
        for i, n in growth.items():
            have = self.slots[i].pages
            pages += self.pool.allocate(n, after=have[-1] if have else None)
            entries += [(i, j) for j in range(len(have), len(have) + n)]
        if pages:
            self.attach(entries, pages)

    def attach(self, entries: list[tuple[int, int]], pages: list[int]) -> None:
        """Map allocated `pages` at (slot, page index) `entries`, each after its
        slot's last page, taking the zero page away first where it is mapped
        there; if mapping fails, the pages go back to the pool.  At the mapping
        limit, idle slots' pages (which hold mapping entries too) are unmapped
        and the call tried once more."""
        self.readable_range = None
        filled = [e for e in entries if e in self.zero_filled]
        if filled:
            self._unmap(filled)
            self.zero_filled.difference_update(filled)
        try:
            try:
                self._map(entries, pages)
            except MapLimitError:
                targets = {i for i, _ in entries}  # idle while being allocated, but not to be cut
                idle = sum(len(s.pages) for i, s in enumerate(self.slots) if not s.active and i not in targets)
                if not idle:
                    raise
                self.reclaim(idle, dict.fromkeys(targets, self.config.max_seq_len))  # only idle slots are cut
                self._map(entries, pages)
        except BaseException:
            self.pool.release(pages)
            raise
        self.map_calls += 1
        for (i, _), page in zip(entries, pages):
            self.slots[i].pages.append(page)

    def _map(self, entries: list[tuple[int, int]], pages: list[int]) -> None:
        """Draw the mapping entries the slots will take with `pages`, and map them."""
        grown = {}
        for (i, _), page in zip(entries, pages):
            grown.setdefault(i, self.slots[i].pages[:]).append(page)
        n = sum(slot_entries(p, self.run) - slot_entries(self.slots[i].pages, self.run) for i, p in grown.items())
        self.storage.draw_entries(n)
        try:
            self.storage.map(entries, pages)
        except BaseException:
            self.storage.draw_entries(-n)
            raise
        self.entries += n

    def cut(self, cuts: Mapping[int, int]) -> int:
        """Let go each slot's pages from index `cuts[slot]` on, in one unmap
        call.  Returns the pages freed (back on the free list; `release`
        gives their memory back)."""
        entries = [(i, j) for i, keep in cuts.items() for j in range(keep, len(self.slots[i].pages))]
        if not entries:
            return 0
        pages = [self.slots[i].pages[j] for i, j in entries]
        self.readable_range = None
        self._unmap(entries)
        self.unmap_calls += 1
        n = 0
        for i, keep in cuts.items():
            n += slot_entries(self.slots[i].pages, self.run)
            del self.slots[i].pages[keep:]
            n -= slot_entries(self.slots[i].pages, self.run)
        self.storage.draw_entries(-n)
        self.entries -= n
        return len(self.pool.release(pages))

    def _unmap(self, entries: list[tuple[int, int]]) -> None:
        """Unmap (slot, page index) `entries`, counted as unmapped whatever happens at the mapping limit.

        There some runs may not unmap (each run is tried) and still show what they showed.  Counting them
        unmapped all the same, the records never claim a page the memory lacks (which a write would fault
        on); what is left showing is never reached through that address again (a slot reaches only the
        pages its record holds), and the next map there replaces it."""
        try:
            self.storage.unmap(entries)
        except MapLimitError:
            self.map_limit_hits += 1

    def release_free(self) -> None:
        """Give the memory of every free page back where the storage can."""
        self.storage.release(self.pool.free_pages())

    # ------------------------------------------------------------ states

    def shared_prefix(self, s: Slot) -> int:
        """Pages before this index may be shared; from it on all are private."""
        while s.shared_pages and self.pool.refs[s.pages[s.shared_pages - 1]] == 1:
            s.shared_pages -= 1
        return s.shared_pages

    def make_idle(self, s: Slot) -> None:
        s.capacity = s.shared_pages = 0
        s.written = [0] * self.config.num_layers
        s.idle_since = next(self.clock)

    def read(self, i: int, start: int, nbytes: int):
        """`[num_buffers, nbytes]` of slot i from byte `start`, in every buffer."""
        return self.storage.read(i, self.slots[i].pages, start, nbytes)

    def write(self, i: int, start: int, data) -> None:
        self.storage.write(i, self.slots[i].pages, start, data)


def slot_entries(pages: list[int], run: int = 0) -> int:
    """The mapping entries a slot's pages take in a buffer, at most: one per run
    of consecutive pages (consecutive in the pool too, the OS merges them; in a
    shared pool a run also ends at each chunk of `run` pages) and one for the
    unmapped rest of the slot."""
    if not pages:
        return 0
    return 2 + sum(b != a + 1 or (run and b % run == 0) for a, b in zip(pages, pages[1:]))


def short_at_map_limit(no_room):
    """Run a mapping operation of an object holding a `table`; at the mapping
    limit it changed nothing, is counted in `map_limit_hits`, and returns
    `no_room`, its answer when memory is short."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except MapLimitError:
                self.table.map_limit_hits += 1
                return no_room
        return run
    return wrap
