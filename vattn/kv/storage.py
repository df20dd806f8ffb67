"""Where a cache's bytes live: the few calls the slot bookkeeping makes.

`SlotCache` decides which page goes where; a storage puts it there.  Two
storages meet this protocol: `VirtualStorage` maps pages into virtually
contiguous buffers (`vattn.kv.virtual`), `PagedStorage` keeps them as blocks
of a pool reached through block tables (`vattn.kv.paged`).  `entries` are
(slot, page index) pairs; a `table` is a slot's pages in token order.
"""
from collections.abc import Sequence
from typing import Protocol

import torch



class Storage(Protocol):
    device: torch.device
    zero_backed: bool  # rows with no page behind them read as zeros instead of faulting

    def draw_entries(self, n: int) -> None:
        """Count `n` more mapping entries in each buffer (fewer where negative) against the process's
        limit on mappings: `MapLimitError`, nothing counted, past what the process can spare."""

    def map_zero(self, entries: list[tuple[int, int]]) -> None:
        """Put the read-only zero page at `entries` (where nothing backs what is not mapped)."""

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

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as kernels address them."""

    def rows(self, layer: int, lo: int, hi: int, tables: Sequence[list[int]], length: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[hi - lo, length, H, D]` of slots lo..hi-1 (`tables` theirs)."""
