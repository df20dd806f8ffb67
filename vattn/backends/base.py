"""The contract every VMM backend meets; the layers above use nothing else.

A backend hands out *reservations* (virtual ranges with nothing behind them)
and *pools* (a fixed set of physical pages, all created up front so the hot
path never allocates), and maps pool pages at page-aligned offsets of a
reservation.  Offsets are in bytes from the reservation's start; pages are
indices into the pool.  A reservation has `.addr` and `.nbytes`; tensors over
it are DLPack views on the backend's device that keep it alive.
"""
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

import vattn.binding as binding
from vattn.backends.map_entries import Hold

_DLPACK_DEVICES = {"cpu": 1, "cuda": 2}  # kDLCPU, kDLCUDA


class Backend(ABC):
    name: str
    device: torch.device
    granularity: int  # page sizes must be multiples of this
    zero_backing: bool  # whether `reserve(zero_backed=True)` is possible

    @abstractmethod
    def reserve(self, nbytes: int, zero_backed: bool = False):
        """Reserve `nbytes` of virtual addresses.  With `zero_backed` (where
        `zero_backing`), addresses with no page mapped read as zeros (one
        shared read-only page) instead of faulting, so a kernel that
        over-reads cannot crash."""

    @abstractmethod
    def create_pool(self, num_pages: int, page_size: int):
        """Create `num_pages` physical pages of `page_size` bytes.  The pool has
        `.num_pages` and `.page_size`."""

    @abstractmethod
    def view(self, pool, page_size: int):
        """The same physical memory as `pool`, counted in pages of `page_size`
        bytes (a shared pool's caches each have their own page size)."""

    @abstractmethod
    def map(self, reservation, pool, offsets: Sequence[int], pages: Sequence[int]) -> None:
        """Map pool page `pages[i]` at `offsets[i]`; all or nothing."""

    @abstractmethod
    def map_zero(self, reservation, pool, offsets: Sequence[int]) -> None:
        """Map one shared page of zeros, the size of the pool's pages and
        read-only (a stray write faults instead of reaching other slots), at
        `offsets`; all or nothing.  `unmap` takes it away like a pool page."""

    @abstractmethod
    def unmap(self, reservation, pool, offsets: Sequence[int]) -> None:
        """Unmap the pages at `offsets`, once no pending work reads them."""

    @abstractmethod
    def release(self, pool, pages: Sequence[int]) -> None:
        """Give the memory of unmapped, unreferenced pages back where the
        backend can (the host's then read as zeros when next mapped; a CUDA
        pool is the budget, held from the start, so nothing happens)."""

    def zero(self, pool, pages: Sequence[int]) -> None:
        """Make unmapped pages read as zeros before another cache maps them
        (a shared pool's chunk changing hands), giving their memory back
        where `release` does: by default `release`, after which they read as zeros."""
        self.release(pool, pages)

    @abstractmethod
    def committed_bytes(self, pool) -> int:
        """Physical memory the pool holds now."""

    def map_entries(self) -> Hold:
        """A hold on the mapping entries the OS lets the process have, for one
        cache's reservation (`vattn.backends.map_entries`); the base holds
        them without limit."""
        return Hold(None)

    def tensor(self, reservation, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int],
               offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor over the reservation (`offset` and `strides` in
        elements of `dtype`) on this backend's device, built from a DLPack
        capsule that names the device: nothing is copied, torch's allocator is
        not involved, and the reservation lives as long as the tensor."""
        capsule = binding.dlpack(reservation, reservation.addr, reservation.nbytes,
                                 _DLPACK_DEVICES[self.device.type], self.device.index or 0)
        return torch.from_dlpack(capsule).view(dtype).as_strided(shape, strides, offset)

    def check_page_size(self, page_size: int) -> None:
        if page_size <= 0 or page_size % self.granularity:
            raise ValueError(f"page_size must be a positive multiple of {self.granularity} bytes "
                             f"on the {self.name} backend, got {page_size}")
