"""One physical KV budget that several caches draw from: several models, one pool.

A `KVPool` is one physical pool of the backend (on the host one `memfd`, on
CUDA one set of `cuMemCreate` handles) cut into chunks of `chunk_size` bytes.
Each model is a *member* (`add`); its cache (`VirtualKVCache(..., member=m)`)
holds whole chunks and lays E = ⌊chunk_size / page_bytes⌋ of its pages in
each, buffer-major: page i of a chunk in buffer b is the chunk's physical
page b·E + i (what is left of a chunk past E pages is unused).  A slot's pages
that fall in one chunk are so consecutive in every buffer, and the host
kernel merges their mappings as in a cache of its own: a slot's mapping
entries break at most once per chunk more (`vattn.kv.table.slot_entries`),
whatever the other members do.

Policy.  A member never holds more than its cap, and the chunks the other
members' unmet floors still need are kept for them.  A member short of pages
takes free chunks first, then reclaims its own idle pages (deferred
reclamation, `SlotTable.make_room`), then takes idle chunks of the others
above their floors, from the member with the most first; only when none is
left does its scheduler preempt.  A chunk changes hands only when no active
slot holds a page of it, so a member never loses the pages its running
requests hold; its memory is given back on the way (the host's reads as
zeros, CUDA's is zeroed), so no model reads another's K/V.

The caches of one pool are driven from one thread at a time (`vattn serve`'s
step loop does so); the lock keeps the books whole for readers elsewhere.
"""
import threading
import weakref
from dataclasses import dataclass

from vattn.backends import get_backend
from vattn.checks import is_int
from vattn.config import MiB

__all__ = ["CHUNK_SIZE", "KVPool", "MemberSplit", "PoolMember"]

CHUNK_SIZE = 32 * MiB  # a multiple of CUDA's 2 MiB granularity; a SmolLM2 page (1.4 MiB on the host) fits 22 times


@dataclass(frozen=True, slots=True)
class MemberSplit:
    """A member's share of the pool, in bytes."""
    floor: int
    cap: int
    held: int  # chunks it holds
    mapped: int  # pages in use by its slots, active or idle
    idle: int  # pages only its idle slots hold


class KVPool:
    """`memory_budget` bytes (rounded down to whole chunks) of physical KV
    memory on `device`, shared by the members' caches."""

    def __init__(self, memory_budget: int, device: str = "cpu", chunk_size: int = CHUNK_SIZE):
        self.backend = get_backend(device)
        g = self.backend.granularity
        if not is_int(chunk_size) or chunk_size <= 0 or chunk_size % g:
            raise ValueError(f"chunk_size must be a positive multiple of {g} bytes on the {self.backend.name} "
                             f"backend, got {chunk_size!r}")
        if not is_int(memory_budget) or memory_budget < chunk_size:
            raise ValueError(f"a pool's memory_budget must be an int of at least one chunk ({chunk_size} bytes), "
                             f"got {memory_budget!r}")
        self.chunk_size = chunk_size
        self.num_chunks = memory_budget // chunk_size
        self.memory_budget = self.num_chunks * chunk_size
        self.physical = self.backend.create_pool(self.memory_budget // g, g)
        self.owner: list[PoolMember | None] = [None] * self.num_chunks
        self.members: dict[str, PoolMember] = {}
        self.moves = 0  # chunks that went from one member to another
        self.lock = threading.RLock()

    # ------------------------------------------------------------ members and their limits

    def add(self, name: str, floor: int = 0, cap: int | None = None) -> "PoolMember":
        """A new member: `floor` bytes guaranteed (rounded up to whole chunks),
        at most `cap` bytes (rounded down; None: the whole budget)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a member needs a name (a non-empty str), got {name!r}")
        with self.lock:
            if name in self.members:
                raise ValueError(f"the pool has a member named {name!r} already")
            member = PoolMember(self, name)
            self._limits(member, floor, self.memory_budget if cap is None else cap)
            self.members[name] = member
            return member

    def member(self, name: str) -> "PoolMember":
        try:
            return self.members[name]
        except KeyError:
            raise ValueError(f"the pool has no member {name!r} (it has {sorted(self.members)})") from None

    def set_limits(self, name: str, floor: int | None = None, cap: int | None = None) -> None:
        """Change a member's floor and cap (bytes; None keeps the current one).
        A cap below the chunks its active slots use is refused; a lower cap
        takes its idle chunks back at once."""
        with self.lock:
            m = self.member(name)
            self._limits(m, m.floor * self.chunk_size if floor is None else floor,
                         m.cap * self.chunk_size if cap is None else cap)

    def _limits(self, m: "PoolMember", floor, cap) -> None:
        """Check and set a member's limits; nothing changes on a refusal."""
        for what, value in (("floor", floor), ("cap", cap)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{m.name}'s {what} must be a byte count (an int >= 0), got {value!r}")
        floor_chunks, cap_chunks = -(-floor // self.chunk_size), min(cap // self.chunk_size, self.num_chunks)
        floors = floor_chunks + sum(o.floor for o in self.members.values() if o is not m)
        if floors > self.num_chunks:
            raise ValueError(f"the floors would add up to {floors} chunks of {self.chunk_size} bytes; the pool has "
                             f"{self.num_chunks}")
        if cap_chunks < floor_chunks:
            raise ValueError(f"{m.name}'s cap ({cap_chunks} chunks) is below its floor ({floor_chunks} chunks)")
        busy = m.held - m.reclaimable()
        if cap_chunks < busy:
            raise ValueError(f"{m.name}'s running requests use {busy} chunks; its cap cannot go below that "
                             f"(asked: {cap_chunks})")
        m.floor, m.cap = floor_chunks, cap_chunks
        if m.held > cap_chunks:
            self._move(m, m.held - cap_chunks, None)

    # ------------------------------------------------------------ chunks

    @property
    def free_chunks(self) -> int:
        return self.owner.count(None)

    def free_for(self, m: "PoolMember") -> int:
        """Free chunks `m` may take: the others' unmet floors are kept for them."""
        owed = sum(max(0, o.floor - o.held) for o in self.members.values() if o is not m)
        return max(0, self.free_chunks - owed)

    def _move(self, source: "PoolMember | None", n: int, target: "PoolMember | None") -> int:
        """Up to `n` chunks from `source` (None: the free ones) to `target`
        (None: free), their memory given back on the way.  Returns the chunks moved."""
        with self.lock:
            if source is None:
                chunks = [c for c, o in enumerate(self.owner) if o is None][:n]
            else:
                chunks = source.let_go(n)
                self._clear(chunks)
            for c in chunks:
                self.owner[c] = target
            if target is not None:
                target.receive(chunks)
            self.moves += len(chunks) if source is not None and target is not None else 0
            return len(chunks)

    def _clear(self, chunks: list[int]) -> None:
        """Make `chunks` read as zeros (`Backend.zero`: the host gives their memory back, CUDA zeroes them)."""
        per = self.chunk_size // self.physical.page_size
        self.backend.zero(self.physical, [c * per + i for c in chunks for i in range(per)])

    def split(self) -> dict[str, MemberSplit]:
        with self.lock:
            return {name: m.split() for name, m in self.members.items()}

    def check(self) -> None:
        """Assert the books balance: every chunk free or held by one member,
        no member past its cap, the floors within the budget."""
        with self.lock:
            held = {}
            for m in self.members.values():
                for c in m.chunks:
                    if c is not None:
                        assert c not in held, f"chunk {c} is held twice"
                        held[c] = m
                assert m.held <= m.cap, f"{m.name} holds {m.held} chunks, past its cap of {m.cap}"
                m.check()
            for c, o in enumerate(self.owner):
                assert held.get(c) is o, f"chunk {c}'s owner is not the member holding it"
            assert sum(m.floor for m in self.members.values()) <= self.num_chunks, "the floors exceed the pool"


class PoolMember:
    """One model's share of a `KVPool`: the chunks its cache holds (`chunks[k]`
    is the physical chunk behind its pages k·E..k·E+E-1), its floor and cap
    (in chunks)."""

    def __init__(self, pool: KVPool, name: str):
        self.pool, self.name = pool, name
        self.floor, self.cap = 0, pool.num_chunks
        self.chunks: list[int | None] = []
        self.per_chunk = 0  # E: the cache's pages per chunk
        self._table = lambda: None

    # ------------------------------------------------------------ the cache that draws on it

    def bind(self, table, page_bytes: int, page_size: int) -> None:
        """Become the memory of `table` (a `SlotTable`), whose pages take
        `page_size` bytes in each buffer, `page_bytes` in all."""
        chunk = self.pool.chunk_size
        if self._table() is not None:
            raise ValueError(f"pool member {self.name!r} already has a cache")
        if chunk % page_size or page_bytes > chunk:
            raise ValueError(f"pages of {page_size} bytes per buffer ({page_bytes} in all) do not tile the pool's "
                             f"chunks of {chunk} bytes")
        self.per_chunk = chunk // page_bytes
        self.chunks = [None] * self.pool.num_chunks
        self._table = weakref.ref(table)
        weakref.finalize(table, self._unbind).atexit = False  # at exit the memory goes with the process

    def _unbind(self) -> None:
        """The cache is gone: its chunks go back to the pool."""
        p = self.pool
        with p.lock:
            gone = [c for c in self.chunks if c is not None]
            p._clear(gone)
            for c in gone:
                p.owner[c] = None
            self.chunks = [None] * len(self.chunks)

    @property
    def table(self):
        table = self._table()
        if table is None:
            raise ValueError(f"pool member {self.name!r} has no cache")
        return table

    @property
    def num_pages(self) -> int:
        """The pages of the whole budget in this member's geometry (those it holds are `table.pool`'s held)."""
        return self.pool.num_chunks * self.per_chunk

    @property
    def held(self) -> int:
        return sum(c is not None for c in self.chunks)

    def physical_pages(self, pages: list[int], num_buffers: int) -> list[int]:
        """Physical pages (of the cache's page size) of `pages`, buffer-major."""
        E, per = self.per_chunk, self.pool.chunk_size // self.table.config.page_size
        return [self.chunks[p // E] * per + b * E + p % E for b in range(num_buffers) for p in pages]

    def most_pages(self) -> int:
        """Pages the member could ever hold: its cap, less the others' floors."""
        others = sum(o.floor for o in self.pool.members.values() if o is not self)
        return min(self.cap, self.pool.num_chunks - others) * self.per_chunk

    # ------------------------------------------------------------ what it may take and give

    def busy_chunks(self) -> set[int]:
        """Its chunks (logical) holding a page of an active slot."""
        E = self.per_chunk
        return {p // E for s in self.table.slots if s.active for p in s.pages}

    def reclaimable(self) -> int:
        """Chunks it would let go with every idle page reclaimed."""
        return self.held - len(self.busy_chunks()) if self._table() is not None else self.held

    def spare_chunks(self) -> int:
        """Chunks it would give another member: reclaimable ones above its floor."""
        return max(0, min(self.reclaimable(), self.held - self.floor))

    def obtainable(self) -> int:
        """Pages it could come to hold now, past those it holds."""
        p = self.pool
        with p.lock:
            others = sum(o.spare_chunks() for o in p.members.values() if o is not self)
            return max(0, min(self.cap - self.held, p.free_for(self) + others)) * self.per_chunk

    def take_free(self, pages: int) -> None:
        """Free chunks for at least `pages` pages, as many as its cap and the others' floors allow."""
        n = min(-(-pages // self.per_chunk), self.cap - self.held, self.pool.free_for(self))
        if n > 0:
            self.pool._move(None, n, self)

    def take_idle(self, pages: int) -> None:
        """Idle chunks of the other members for at least `pages` pages, the member with the most spare first."""
        p = self.pool
        n = min(-(-pages // self.per_chunk), self.cap - self.held)
        with p.lock:
            others = sorted((o for o in p.members.values() if o is not self and o._table() is not None),
                            key=lambda o: -o.spare_chunks())
            for o in others:
                spare = min(n, o.spare_chunks())
                if spare > 0:
                    n -= p._move(o, spare, self)

    def give_back(self) -> None:
        """Return its wholly free chunks above its floor to the pool."""
        n = min(len(self._free_chunks()), self.held - self.floor)
        if n > 0:
            self.pool._move(self, n, None)

    def let_go(self, n: int) -> list[int]:
        """Give up to `n` chunks that no active slot holds, reclaiming idle
        slots' pages (least recently idle first) until enough are wholly free.
        Returns the physical chunks, their pages gone from the cache's pool."""
        t, E = self.table, self.per_chunk
        free = self._free_chunks()
        idle = sorted((s.idle_since, i) for i, s in enumerate(t.slots) if not s.active and s.pages)
        while len(free) < n and idle:
            t.cut({idle.pop(0)[1]: 0})
            free = self._free_chunks()
        give = sorted(free, reverse=True)[:n]
        t.pool.remove([p for k in give for p in range(k * E, k * E + E)])
        physical = [self.chunks[k] for k in give]
        for k in give:
            self.chunks[k] = None
        return physical

    def receive(self, chunks: list[int]) -> None:
        """Hold physical `chunks`, at the lowest logical places free (whose pages go out first)."""
        E, places = self.per_chunk, [k for k, c in enumerate(self.chunks) if c is None]
        for k, c in zip(places, chunks):
            self.chunks[k] = c
            self.table.pool.add(list(range(k * E, k * E + E)))

    def _free_chunks(self) -> list[int]:
        """Its chunks (logical) whose pages are all free."""
        E, free = self.per_chunk, {}
        if self._table() is None:
            return []
        for p in self.table.pool.free_pages():
            free[p // E] = free.get(p // E, 0) + 1
        return [k for k, n in free.items() if n == E]

    # ------------------------------------------------------------ figures

    def split(self) -> MemberSplit:
        chunk, table = self.pool.chunk_size, self._table()
        mapped = idle = 0
        if table is not None:
            page = table.config.page_bytes
            mapped = table.pool.num_used * page
            idle = sum(len(s.pages) for s in table.slots if not s.active) * page
        return MemberSplit(self.floor * chunk, self.cap * chunk, self.held * chunk, mapped, idle)

    def check(self) -> None:
        table = self._table()
        if table is None:
            assert not self.held, f"{self.name} holds chunks with no cache"
            return
        E = self.per_chunk
        for k, c in enumerate(self.chunks):
            held = [table.pool.is_held(p) for p in range(k * E, k * E + E)]
            assert all(held) if c is not None else not any(held), f"{self.name}'s chunk {k} is half held"
