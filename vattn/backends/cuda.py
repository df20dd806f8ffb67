"""CUDA backend: the driver's virtual memory management, through cuda-python.

`cuMemAddressReserve` reserves a range; the physical pool is one
`cuMemCreate` handle per page, all made (and zeroed) when the pool is made,
since creating one costs ~200 µs and must stay off the hot path.  `cuMemMap`
puts a handle at an address (the same handle at several addresses is page
sharing) and `cuMemSetAccess` opens each contiguous run of newly mapped
pages in one call (~36 µs a call, so never per page).  `map_zero` maps one
zeroed handle per page size, read-only, wherever it is asked.

`cuMemUnmap` is not ordered with the GPU's work: unmapping a page that a
queued kernel still reads would fault.  `unmap` therefore records an event on
each of the backend's streams (the compute stream, current when the backend
was made, and any registered with `use_stream`) and leaves the pages mapped
until those events have completed: every later call unmaps what has
completed, and mapping at an address still waiting waits for its events.
There is one backend per device (`vattn.backends.get_backend`).
"""
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vattn.backends.base import Backend


class CudaUnavailable(RuntimeError):
    """The CUDA backend cannot run here (no cuda-python, driver, device or CUDA torch)."""


def cuda_driver():
    """cuda-python's `cuda.bindings.driver` module."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CudaUnavailable("cuda-python is not installed (pip install 'vattn[cuda]')") from None
    return driver


def unavailable() -> str | None:
    """Why the CUDA backend cannot run here, or None if it can."""
    try:
        driver = cuda_driver()
    except CudaUnavailable as e:
        return str(e)
    try:
        err, = driver.cuInit(0)
    except RuntimeError as e:  # the bindings raise when libcuda cannot be loaded
        return f"no CUDA driver ({e})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA device (cuInit: {_name(err)})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} was built without CUDA"
    return None


def _name(err) -> str:
    _, name = cuda_driver().cuGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(err)


def check(result, what: str):
    """The value(s) of a cuda-python call, or a clear error."""
    err, *values = result
    if err != cuda_driver().CUresult.CUDA_SUCCESS:
        kind = MemoryError if err == cuda_driver().CUresult.CUDA_ERROR_OUT_OF_MEMORY else RuntimeError
        raise kind(f"{what} failed: {_name(err)}")
    return values[0] if len(values) == 1 else values


def _runs(offsets: list[int], size: int) -> list[tuple[int, int]]:
    """(start, length) of each run of adjacent pages among sorted `offsets`."""
    runs = []
    for o in offsets:
        if runs and runs[-1][0] + runs[-1][1] == o:
            runs[-1] = (runs[-1][0], runs[-1][1] + size)
        else:
            runs.append((o, size))
    return runs


@dataclass(slots=True, eq=False)
class CudaPool:
    """One `cuMemCreate` handle per page; released when the pool goes (the
    memory itself once no address maps it any more)."""

    handles: list
    page_size: int
    backend: "CudaBackend"  # kept alive: its primary context must outlive the handles

    @property
    def num_pages(self) -> int:
        return len(self.handles)

    def __del__(self):
        if sys.is_finalizing():  # the process is going: so is the memory
            return
        driver = cuda_driver()
        for h in self.handles:
            driver.cuMemRelease(h)
        self.handles = []


class CudaReservation:
    """A reserved range of device addresses, the pages mapped in it, and the
    unmaps waiting for the GPU.  When the last reference goes (the cache's,
    or a tensor's over it) the GPU is waited for, every page unmapped and the
    range freed.  `lock` guards `mapped` and `pending` (the mapping worker and
    a collector may touch them from other threads)."""

    zero_backed = False

    def __init__(self, backend: "CudaBackend", nbytes: int):
        self.backend, self.nbytes, self.addr = backend, nbytes, None
        self.addr = int(check(cuda_driver().cuMemAddressReserve(nbytes, backend.granularity, 0, 0),
                               "cuMemAddressReserve"))
        self.mapped: dict[int, int] = {}  # offset -> page size, as the cache sees it
        self.pending: deque[tuple[list[torch.cuda.Event], dict[int, int]]] = deque()  # unmaps waiting for the GPU
        self.lock = threading.RLock()

    def settle(self, wait_for: Sequence[int] = ()) -> None:
        """Unmap the pending pages whose readers have finished, and, waiting
        for them, those at `wait_for` (about to be mapped again)."""
        with self.lock:
            wanted = set(wait_for)
            while self.pending:
                events, offsets = self.pending[0]
                if not all(e.query() for e in events):
                    if wanted.isdisjoint(o for entry in self.pending for o in entry[1]):
                        return
                    for e in events:
                        e.synchronize()
                self.pending.popleft()
                self._unmap_now(offsets)

    def _unmap_now(self, pages: dict[int, int]) -> None:
        driver = cuda_driver()
        for offset, size in pages.items():
            check(driver.cuMemUnmap(self.addr + offset, size), "cuMemUnmap")

    def close(self) -> None:
        """Wait for the backend's streams, unmap everything, free the range."""
        if self.addr is None:
            return
        try:
            self.backend.activate()
            for stream in self.backend.streams:
                stream.synchronize()
            with self.lock:
                self.settle()
                self._unmap_now(self.mapped)
                self.mapped.clear()
            check(cuda_driver().cuMemAddressFree(self.addr, self.nbytes), "cuMemAddressFree")
        finally:
            self.addr = None

    def __del__(self):
        if not sys.is_finalizing():  # the process is going: so is the range
            self.close()


class CudaBackend(Backend):
    name = "cuda"
    zero_backing = False  # no shared zero page: kernels read only what is mapped

    def __init__(self, device: str | torch.device = "cuda"):
        why = unavailable()
        if why:
            raise CudaUnavailable(f"the CUDA backend cannot run here: {why}")
        device = torch.device(device)
        index = torch.cuda.current_device() if device.index is None else device.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"no CUDA device {index} (this machine has {torch.cuda.device_count()})")
        self.device = torch.device("cuda", index)
        driver = cuda_driver()
        torch.cuda.init()
        self._dev = check(driver.cuDeviceGet(index), "cuDeviceGet")
        self._ctx = check(driver.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self.activate()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self.allocation_prop = prop  # what cuMemCreate makes: pinned memory on this device
        self.granularity = int(check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access_descs = [access]  # what cuMemSetAccess grants: this device reads and writes
        read = driver.CUmemAccessDesc()
        read.location.type, read.location.id = access.location.type, index
        read.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self.read_descs = [read]  # the zero page's: this device reads only
        self._zero_pages: dict[int, CudaPool] = {}  # page size -> one zeroed page (`map_zero`)
        self._lock = threading.Lock()
        self.streams = [torch.cuda.current_stream(self.device)]  # the streams unmaps wait for (`use_stream`)

    def use_stream(self, stream: torch.cuda.Stream) -> None:
        """Make unmaps wait for the work queued on `stream` too, as they wait
        for the compute stream (the stream current when the backend was made):
        register every stream kernels reading the cache's views run on, like
        `Tensor.record_stream` for torch's allocator."""
        if stream.device != self.device:
            raise ValueError(f"stream is on {stream.device}; this backend manages {self.device}")
        if stream not in self.streams:
            self.streams.append(stream)

    def __del__(self):
        if not sys.is_finalizing() and hasattr(self, "_ctx"):
            cuda_driver().cuDevicePrimaryCtxRelease(self._dev)

    def activate(self) -> None:
        """Make the device's primary context current on a thread that has
        none (the mapping worker); one torch made current is left alone."""
        driver = cuda_driver()
        if int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
            check(driver.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def reserve(self, nbytes: int, zero_backed: bool = False) -> CudaReservation:
        if zero_backed:
            raise ValueError("the CUDA backend has no zero page: kernels must read mapped pages only")
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % self.granularity:
            raise ValueError(f"reservation size must be a positive multiple of {self.granularity} bytes, "
                             f"got {nbytes!r}")
        self.activate()
        return CudaReservation(self, nbytes)

    def create_pool(self, num_pages: int, page_size: int) -> CudaPool:
        self.check_page_size(page_size)
        if num_pages <= 0:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self.activate()
        driver = cuda_driver()
        pool = CudaPool([], page_size, self)
        for _ in range(num_pages):  # on failure, `pool` going away releases what was made
            pool.handles.append(check(driver.cuMemCreate(page_size, self.allocation_prop, 0),
                                       f"cuMemCreate of page {pool.num_pages + 1} of {num_pages} "
                                       f"({page_size} bytes each)"))
        self.zero(pool, range(num_pages))
        return pool

    def zero(self, pool: CudaPool, pages: Sequence[int]) -> None:
        """Zero `pages` through a scratch mapping.  Fresh handles hold whatever the GPU held, and a
        masked row must read as finite; a shared pool's pages are zeroed before another cache has them."""
        if not (pages := list(pages)):
            return
        torch.cuda.synchronize(self.device)  # no queued kernel still writes them
        scratch = self.reserve(len(pages) * pool.page_size)
        self.map(scratch, pool, [i * pool.page_size for i in range(len(pages))], pages)
        self.tensor(scratch, torch.uint8, (scratch.nbytes,), (1,)).zero_()
        torch.cuda.synchronize(self.device)
        scratch.close()

    def view(self, pool: CudaPool, page_size: int) -> CudaPool:
        if page_size != pool.page_size:
            raise ValueError(f"a CUDA pool's pages are its handles: a cache over it takes pages of {pool.page_size} "
                             f"bytes, not {page_size}")
        return pool

    def map(self, reservation: CudaReservation, pool: CudaPool, offsets: Sequence[int],
            pages: Sequence[int]) -> None:
        self._map(reservation, pool, offsets, pages, self.access_descs)

    def map_zero(self, reservation: CudaReservation, pool: CudaPool, offsets: Sequence[int]) -> None:
        with self._lock:
            if pool.page_size not in self._zero_pages:
                self._zero_pages[pool.page_size] = self.create_pool(1, pool.page_size)  # made zeroed
            zero = self._zero_pages[pool.page_size]
        offsets = list(offsets)
        self._map(reservation, zero, offsets, [0] * len(offsets), self.read_descs)

    def _map(self, reservation: CudaReservation, pool: CudaPool, offsets, pages, access_descs) -> None:
        """Map pool page `pages[i]` at `offsets[i]`, opened with `access_descs`."""
        self.activate()
        driver, size, base = cuda_driver(), pool.page_size, reservation.addr
        with reservation.lock:
            offsets, pages = self._checked(reservation, pool, offsets, pages)
            reservation.settle(offsets)
            done = []
            try:
                for o, p in zip(offsets, pages):
                    check(driver.cuMemMap(base + o, size, 0, pool.handles[p], 0), "cuMemMap")
                    done.append(o)
                for start, length in _runs(sorted(offsets), size):
                    check(driver.cuMemSetAccess(base + start, length, access_descs, 1), "cuMemSetAccess")
            except BaseException:
                for o in done:  # nothing has read them yet
                    driver.cuMemUnmap(base + o, size)
                raise
            reservation.mapped.update((o, size) for o in offsets)

    def unmap(self, reservation: CudaReservation, pool: CudaPool, offsets: Sequence[int]) -> None:
        offsets = [int(o) for o in offsets]
        if not offsets:
            return
        self.activate()
        with reservation.lock:
            missing = [o for o in offsets if o not in reservation.mapped]
            if missing or len(set(offsets)) != len(offsets):
                raise ValueError(f"virtual offsets {missing or offsets} are not each mapped once in this "
                                 f"reservation")
            events = [torch.cuda.Event() for _ in self.streams]
            for event, stream in zip(events, self.streams):
                event.record(stream)
            reservation.pending.append((events, {o: reservation.mapped.pop(o) for o in offsets}))
            reservation.settle()

    def release(self, pool: CudaPool, pages: Sequence[int]) -> None:
        """Nothing: the pool is the memory budget, held from the start."""

    def committed_bytes(self, pool: CudaPool) -> int:
        return pool.num_pages * pool.page_size

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of this device's memory (whichever context the
        calling thread has current)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def _checked(self, reservation, pool, offsets, pages) -> tuple[list[int], list[int]]:
        """Offsets and pages as ints, or a clear error before anything is mapped."""
        offsets, pages = list(offsets), list(pages)
        if len(offsets) != len(pages):
            raise ValueError(f"{len(offsets)} virtual offsets but {len(pages)} physical pages")
        for x in offsets + pages:
            if not isinstance(x, int) or isinstance(x, bool):
                raise TypeError(f"offsets and pages must be ints, got {x!r}")
        size = pool.page_size
        for o in offsets:
            if o < 0 or o % size or o + size > reservation.nbytes:
                raise ValueError(f"virtual offset {o} is not a {size}-byte-aligned page inside "
                                 f"{reservation.nbytes} bytes")
        taken = [o for o in offsets if o in reservation.mapped]
        if taken or len(set(offsets)) != len(offsets):
            raise ValueError(f"virtual offsets {taken or offsets} are mapped already or given twice")
        for p in pages:
            if not 0 <= p < pool.num_pages:
                raise ValueError(f"physical page {p} is not in the pool of {pool.num_pages}")
        return offsets, pages
