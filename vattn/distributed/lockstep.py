"""Every tensor-parallel rank's cache in lockstep, with no page id exchanged.

Rank 0's scheduler decides; its `KVCacheManager` is wrapped in a
`RecordingKV` that logs each call that changes the cache, in the order made
(the mapping worker's too), with the sequence named by a number and the
answer it got.  The log goes out with each step (`vattn.distributed.ranks`);
every other rank `replay`s it on its own manager over its own cache, which
holds its own KV heads.  The calls are deterministic, so each rank's pages,
slots and prefix hashes come out the same; a different answer anywhere is
an error, never a silent divergence.
"""
import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from vattn.kv.manager import KVCacheManager
from vattn.kv.sharing import SwappedSlot

CHANGES = ("allocate", "allocate_slots", "fork", "map_ahead", "cache_tokens", "free", "drop", "swap_out",
           "swap_in", "discard", "trim")


class Diverged(RuntimeError):
    """A rank's cache answered a replayed call otherwise than rank 0's."""


class RecordingKV:
    """A `KVCacheManager` whose changes are logged for `replay`; queries pass through."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._ops: list[tuple] = []
        self._lock = threading.Lock()  # the mapping worker logs from its thread
        self._names: dict[Hashable, int] = {}  # sequence -> its number
        self._swapped: dict[int, int] = {}  # id(SwappedSlot) -> the number of the sequence it held
        self._next = 0

    def take(self) -> list[tuple]:
        """The calls logged since the last `take`."""
        with self._lock:
            ops, self._ops = self._ops, []
        return ops

    def __getattr__(self, name):
        if name in CHANGES:
            return getattr(self, f"_{name}")
        return getattr(self.kv, name)

    def _log(self, name: str, args: tuple, result) -> None:
        with self._lock:
            self._ops.append((name, args, result))

    def _name(self, seq: Hashable) -> int:
        if seq not in self._names:
            self._names[seq], self._next = self._next, self._next + 1
        return self._names[seq]

    def _allocate(self, seq, token_ids: Sequence[int], num_new_tokens: int, salt: str | None = None):
        cached = self.kv.allocate(seq, token_ids, num_new_tokens, salt)
        self._log("allocate", (self._name(seq), list(token_ids), num_new_tokens, salt), cached)
        return cached

    def _allocate_slots(self, targets: Mapping) -> bool:
        ok = self.kv.allocate_slots(targets)
        self._log("allocate_slots", ({self._name(s): n for s, n in targets.items()},), ok)
        return ok

    def _fork(self, parent, child, num_tokens: int) -> bool:
        ok = self.kv.fork(parent, child, num_tokens)
        self._log("fork", (self._name(parent), self._name(child), num_tokens), ok)
        return ok

    def _map_ahead(self, targets: Mapping) -> None:
        self.kv.map_ahead(targets)
        self._log("map_ahead", ({self._name(s): n for s, n in targets.items()},), None)

    def _cache_tokens(self, seq, token_ids: Sequence[int], num_computed: int) -> None:
        self.kv.cache_tokens(seq, token_ids, num_computed)
        self._log("cache_tokens", (self._name(seq), list(token_ids[:num_computed]), num_computed), None)

    def _free(self, seq) -> None:
        self.kv.free(seq)
        self._log("free", (self._names.pop(seq),), None)

    def _drop(self, seq) -> None:
        self.kv.drop(seq)
        self._log("drop", (self._names.pop(seq),), None)

    def _swap_out(self, seq) -> SwappedSlot:
        swapped = self.kv.swap_out(seq)
        self._swapped[id(swapped)] = self._name(seq)
        self._log("swap_out", (self._name(seq),), None)
        return swapped

    def _swap_in(self, seq, swapped: SwappedSlot, salt: str | None = None) -> bool:
        ok = self.kv.swap_in(seq, swapped, salt)
        held = self._swapped.pop(id(swapped)) if ok else self._swapped[id(swapped)]
        self._log("swap_in", (self._name(seq), held, salt), ok)
        return ok

    def _discard(self, swapped: SwappedSlot) -> None:
        self.kv.discard(swapped)
        self._log("discard", (self._swapped.pop(id(swapped)),), None)

    def _trim(self) -> None:
        self.kv.trim()
        self._log("trim", (), None)


@dataclass
class Replica:
    """A rank's own manager, driven by rank 0's log."""

    kv: KVCacheManager
    swapped: dict[int, SwappedSlot] = field(default_factory=dict)  # a sequence's number -> its KV on the host

    def replay(self, ops: list[tuple]) -> None:
        for name, args, expected in ops:
            own = getattr(self, f"_{name}", None)  # the swaps; the rest are the manager's own
            got = own(*args) if own else getattr(self.kv, name)(*args)
            if got != expected:
                raise Diverged(f"{name}{args!r} answered {got!r} here, {expected!r} on rank 0")

    # swapped KV stays on its own rank: the log names it by the sequence that held it

    def _swap_out(self, seq) -> None:
        self.swapped[seq] = self.kv.swap_out(seq)

    def _swap_in(self, seq, held, salt) -> bool:
        ok = self.kv.swap_in(seq, self.swapped[held], salt)
        if ok:
            del self.swapped[held]
        return ok

    def _discard(self, held) -> None:
        self.kv.discard(self.swapped.pop(held))


def checked_books(kv: KVCacheManager) -> tuple:
    """`books`, the cache checked first (`KVCacheManager.check`)."""
    kv.check()
    return books(kv)


def books(kv: KVCacheManager) -> tuple:
    """A rank's page books, which every rank's must equal: each page's
    references, the free list, each slot's block table, the active slots."""
    cache = kv.cache
    return (list(cache.pool.refs), cache.pool.free_pages(),
            [cache.block_table(i) for i in range(cache.config.max_num_seqs)], cache.active_slots)
