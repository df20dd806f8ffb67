"""Host backend: `mmap` reservations, a `memfd` as the physical pool (the C core, `vattn.binding`)."""
import mmap
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import vattn.binding as binding
from vattn.backends.map_entries import Hold, hold
from vattn.backends.base import Backend


@dataclass(slots=True, frozen=True)
class HostPool:
    file: binding.PhysicalFile
    num_pages: int
    page_size: int

    @property
    def fd(self) -> int:
        return self.file.fd


class HostBackend(Backend):
    name = "host"
    device = torch.device("cpu")
    granularity = binding.os_page_size()
    zero_backing = True

    def __init__(self):
        self._zero_pages: dict[int, binding.PhysicalFile] = {}  # page size -> a file of one page, never written

    def reserve(self, nbytes: int, zero_backed: bool = False) -> binding.Reservation:
        return binding.Reservation(nbytes, zero_backed)

    def map_entries(self) -> Hold:
        return hold()  # the process's budget under vm.max_map_count

    def create_pool(self, num_pages: int, page_size: int) -> HostPool:
        self.check_page_size(page_size)
        if num_pages <= 0:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        return HostPool(binding.PhysicalFile(num_pages * page_size), num_pages, page_size)

    def view(self, pool: HostPool, page_size: int) -> HostPool:
        self.check_page_size(page_size)
        return HostPool(pool.file, pool.num_pages * pool.page_size // page_size, page_size)

    def map(self, reservation, pool: HostPool, offsets: Sequence[int], pages: Sequence[int]) -> None:
        size = pool.page_size
        binding.map_pages(reservation, pool.file, size, offsets, [p * size for p in pages])

    def map_zero(self, reservation, pool: HostPool, offsets: Sequence[int]) -> None:
        size = pool.page_size
        if size not in self._zero_pages:
            self._zero_pages[size] = binding.PhysicalFile(size)
        offsets = list(offsets)
        binding.map_pages(reservation, self._zero_pages[size], size, offsets, [0] * len(offsets), True)

    def unmap(self, reservation, pool: HostPool, offsets: Sequence[int]) -> None:
        binding.unmap_pages(reservation, pool.page_size, offsets)

    def release(self, pool: HostPool, pages: Sequence[int]) -> None:
        size = pool.page_size
        binding.punch_pages(pool.file, size, [p * size for p in sorted(pages)])

    def committed_bytes(self, pool: HostPool) -> int:
        return pool.file.committed()

    def raw_map_loop(self, reservation, pool: HostPool, offsets: Sequence[int],
                     pages: Sequence[int]) -> tuple[float, float]:
        """(map ns, unmap ns) of the syscalls `map` and `unmap` make, one page a call in a plain C
        loop: the floor `vattn bench vmm` holds the library's own paths against."""
        size = pool.page_size
        return binding.raw_map_loop(reservation, pool.file, size, offsets, [p * size for p in pages])


def page_out_file_pages(tensors: Sequence[torch.Tensor]) -> int:
    """Reclaim the resident pages of `tensors` that lie in a mapped file
    (weights loaded by mmap, as safetensors loads them): while any tensor
    keeps the file mapped, the pages a let-go weight was read into stay
    counted in the process, though the file still holds them.  Clean file
    pages are read again if touched, so nothing is lost; tensors in anonymous
    memory are left alone.  Returns the bytes advised."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:  # not Linux: nothing to tell
        return 0
    files = []  # (start, end) of the file mappings
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":
            start, end = fields[0].split("-")
            files.append((int(start, 16), int(end, 16)))
    advised = 0
    for t in tensors:
        lo, nbytes = t.data_ptr(), t.numel() * t.element_size()
        if t.is_cpu and t.is_contiguous() and nbytes and any(s <= lo and lo + nbytes <= e for s, e in files):
            advised += binding.page_out(lo, nbytes)
    return advised


def trim_heap() -> bool:
    """Give the OS back the heap's free memory, which the allocator (tcmalloc
    where the process runs under it, else glibc's) keeps after large frees
    (weights packed or unpacked) to serve later allocations: a second engine
    over a model the first gave back would otherwise hold its unpacked
    weights twice.  Returns whether tcmalloc was found."""
    return binding.trim_heap()


class HugePages:
    """Tensors in anonymous memory advised for transparent huge pages
    (`MADV_HUGEPAGE`, which Linux's default `madvise` mode waits for), carved
    in turn from chunks of at least CHUNK bytes: a GEMM streaming its weights
    from memory then misses the TLB once per 2 MiB, not once per 4 KiB page.
    Where the OS gives no huge pages, they are plain pages.  The tensors
    carved from a chunk keep it mapped, and nothing else does."""

    CHUNK = 64 << 20
    HUGE = 2 << 20  # the huge page size the chunks are aligned to

    def __init__(self):
        self._chunk = lambda: None  # a weak reference to the chunk's memory
        self._end = self._used = 0  # the chunk's bytes from its first huge page, and those carved

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized contiguous tensor of `shape`, 64-byte aligned."""
        numel = torch.Size(shape).numel()
        nbytes = -(-numel * dtype.itemsize // 64) * 64
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        memory = self._chunk()
        if memory is None or self._used + nbytes > self._end:
            size = -(-max(self.CHUNK, nbytes) // self.HUGE) * self.HUGE
            memory = mmap.mmap(-1, size + self.HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                memory.madvise(mmap.MADV_HUGEPAGE)
            self._chunk = weakref.ref(memory)
            self._used = -torch.frombuffer(memory, dtype=torch.uint8).data_ptr() % self.HUGE
            self._end = self._used + size
        out = torch.frombuffer(memory, dtype=torch.uint8, offset=self._used, count=nbytes)
        self._used += nbytes
        return out.view(dtype)[:numel].view(shape)
