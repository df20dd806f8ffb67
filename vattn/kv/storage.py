"""Where a cache's bytes live: the few calls the slot bookkeeping makes.

`SlotCache` decides which page goes where; a storage puts it there.  Two
storages meet this protocol: `VirtualStorage` maps pages into virtually
contiguous buffers (`vattn.kv.virtual`), `PagedStorage` keeps them as blocks
of a pool reached through block tables (`vattn.kv.paged`).  `entries` are
(slot, page index) pairs; a `table` is a slot's pages in token order.
"""
import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from vattn.backends import MapLimitError


class Storage(Protocol):
    device: torch.device
    zero_backed: bool  # rows with no page behind them read as zeros instead of faulting
    views: bool  # `rows` are views of the cache itself (else copies into a buffer the next call reuses)

    def map(self, entries: list[tuple[int, int]], pages: list[int]) -> None:
        """Put page `pages[i]` at `entries[i]`; all or nothing (`MapLimitError`
        at the process's limit on mappings)."""

    def unmap(self, entries: list[tuple[int, int]]) -> None:
        """Take the pages at `entries` away."""

    def release(self, pages: list[int]) -> None:
        """Give the memory of free pages back, where the storage can."""

    def committed_bytes(self) -> int:
        """Physical memory the storage holds now."""

    def read(self, slot: int, table: list[int], start: int, nbytes: int) -> torch.Tensor:
        """`[num_buffers, nbytes]` of the slot from byte `start`, in every buffer."""

    def write(self, slot: int, table: list[int], start: int, data: torch.Tensor) -> None:
        """Put `[num_buffers, n]` bytes into the slot from byte `start`."""

    def store(self, layer: int, slots: list[int], tables: list[list[int]], positions: list[int],
              key: torch.Tensor, value: torch.Tensor) -> None:
        """Put checked `[B, T, H, D]` K/V at each slot's positions."""

    def rows(self, layer: int, lo: int, hi: int, tables: Sequence[list[int]], length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[hi - lo, length, H, D]` of slots lo..hi-1 (`tables` theirs)."""


def short_at_map_limit(no_room):
    """Run a mapping operation; at the mapping limit it changed nothing and
    returns `no_room`, its answer when memory is short."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except MapLimitError:
                self.map_limit_hits += 1
                return no_room
        return run
    return wrap
