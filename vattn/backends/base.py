"""The contract every VMM backend meets; the layers above use nothing else.

A backend hands out *reservations* (virtual ranges with nothing behind them)
and *pools* (a fixed set of physical pages, all created up front so the hot
path never allocates), and maps pool pages at page-aligned offsets of a
reservation.  Offsets are in bytes from the reservation's start; pages are
indices into the pool.
"""
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class Backend(ABC):
    name: str
    device: torch.device
    granularity: int  # page sizes must be multiples of this

    @abstractmethod
    def reserve(self, nbytes: int, zero_backed: bool = False):
        """Reserve `nbytes` of virtual addresses.  With `zero_backed`, addresses
        with no page mapped read as zeros (one shared read-only page) instead
        of faulting, so a kernel that over-reads cannot crash."""

    @abstractmethod
    def create_pool(self, num_pages: int, page_size: int):
        """Create `num_pages` physical pages of `page_size` bytes.  The pool has
        `.num_pages` and `.page_size`."""

    @abstractmethod
    def map(self, reservation, pool, offsets: Sequence[int], pages: Sequence[int]) -> None:
        """Map pool page `pages[i]` at `offsets[i]`; all or nothing."""

    @abstractmethod
    def unmap(self, reservation, pool, offsets: Sequence[int]) -> None:
        """Unmap the pages at `offsets`, once no pending work reads them."""

    @abstractmethod
    def release(self, pool, pages: Sequence[int]) -> None:
        """Give the memory of unmapped, unreferenced pages back; they read as
        zeros when next mapped."""

    @abstractmethod
    def committed_bytes(self, pool) -> int:
        """Physical memory the pool holds now."""

    @abstractmethod
    def tensor(self, reservation, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int],
               offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor over the reservation (`offset` and `strides` in
        elements of `dtype`)."""

    def check_page_size(self, page_size: int) -> None:
        if page_size <= 0 or page_size % self.granularity:
            raise ValueError(f"page_size must be a positive multiple of {self.granularity} bytes "
                             f"on the {self.name} backend, got {page_size}")
