"""The backend contract, on the real host backend and, where a GPU and its
driver are present, the CUDA backend (skipped elsewhere, with the reason)."""
import gc
import os
import subprocess
import sys

import pytest
import torch

from vattn import _native
from vattn.backends import CudaBackend, HostBackend, contract, get_backend
from vattn.backends.cuda import unavailable

NO_CUDA = unavailable()
BACKENDS = [HostBackend, pytest.param(CudaBackend, marks=[pytest.mark.gpu, pytest.mark.skipif(
    NO_CUDA is not None, reason=f"CUDA backend contract: {NO_CUDA}")])]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request):
    return request.param()


def bytes_view(backend, reservation):
    return backend.tensor(reservation, torch.uint8, (reservation.nbytes,), (1,))


def page(backend, size=64 << 10):
    """A page size the backend takes: `size`, or its granularity if larger."""
    return max(size, backend.granularity)


def reserve(backend, nbytes):
    """Zero-backed where the backend can be; kernels below read mapped pages only."""
    return backend.reserve(nbytes, zero_backed=backend.zero_backing)


def test_map_write_unmap(backend):
    assert contract.check(backend)  # the page sizes the backend takes


def test_a_broken_contract_is_named(backend, monkeypatch):
    """The check fails, naming the page size, where a second map brings other pages than asked."""
    real, calls = backend.map, []

    def map_other_pages_second(res, pool, virt, phys):
        calls.append(phys)
        real(res, pool, virt, phys if len(calls) == 1 else [1, 3])

    monkeypatch.setattr(backend, "map", map_other_pages_second)
    with pytest.raises(contract.ContractBroken, match="pages of .* bytes: pages mapped at a second address"):
        contract.check(backend)


def test_unmapped_pages_read_as_zeros_on_the_host():
    backend = HostBackend()
    size = 64 << 10
    res = backend.reserve(2 * size, zero_backed=True)
    pool = backend.create_pool(1, size)
    view = bytes_view(backend, res)
    assert int(view.sum()) == 0
    backend.map(res, pool, [size], [0])
    view[size:] = 1
    backend.unmap(res, pool, [size])
    assert int(view.sum()) == 0


def test_one_page_at_two_addresses_is_shared(backend):
    size = page(backend)
    res = reserve(backend, 2 * size)
    pool = backend.create_pool(1, size)
    backend.map(res, pool, [0, size], [0, 0])
    view = bytes_view(backend, res)
    view[10] = 42
    assert int(view[size + 10]) == 42


def test_host_release_returns_memory_and_zeroes():
    backend = HostBackend()
    size = 64 << 10
    res = backend.reserve(size, zero_backed=True)
    pool = backend.create_pool(2, size)
    assert backend.committed_bytes(pool) == 0
    backend.map(res, pool, [0], [1])
    bytes_view(backend, res)[:].fill_(3)
    assert backend.committed_bytes(pool) == size
    backend.unmap(res, pool, [0])
    backend.release(pool, [1])
    assert backend.committed_bytes(pool) == 0
    backend.map(res, pool, [0], [1])
    assert int(bytes_view(backend, res).sum()) == 0


def test_untouched_mapped_pages_cost_nothing_on_the_host():
    backend = HostBackend()
    size = 2 << 20
    res = backend.reserve(64 * size)
    pool = backend.create_pool(64, size)
    backend.map(res, pool, [j * size for j in range(64)], range(64))
    assert backend.committed_bytes(pool) == 0
    bytes_view(backend, res)[5 * size] = 1
    assert backend.committed_bytes(pool) == backend.granularity  # one OS page touched


def test_tensors_are_zero_copy_on_the_backend_device(backend):
    size = page(backend)
    res = reserve(backend, 2 * size)
    pool = backend.create_pool(1, size)
    backend.map(res, pool, [size], [0])
    t = backend.tensor(res, torch.float32, (4, 8), (16, 1), offset=size // 4 + 4)
    assert t.device == backend.device and t.data_ptr() == res.addr + size + 16
    t.fill_(2.5)
    assert float(bytes_view(backend, res)[size + 16:size + 16 + 32].view(torch.float32).sum()) == 20.0


def test_tensor_views_keep_the_reservation_alive(backend):
    size = page(backend)
    res = reserve(backend, size)
    pool = backend.create_pool(1, size)
    backend.map(res, pool, [0], [0])
    t = backend.tensor(res, torch.float32, (4, 8), (16, 1), offset=4)
    t.fill_(1.0)
    del res
    gc.collect()
    assert float(t.sum()) == 32.0  # still readable: the range was not released under the view


def test_tensor_cannot_reach_past_the_reservation(backend):
    res = reserve(backend, page(backend, 4096))
    with pytest.raises(RuntimeError):
        backend.tensor(res, torch.float32, (res.nbytes // 2,), (1,))


def test_bad_page_size(backend):
    g = backend.granularity
    for bad in (0, 1000, g + 1):
        with pytest.raises(ValueError, match="page_size must be a positive multiple"):
            backend.create_pool(1, bad)


def test_bad_offsets_map_nothing(backend):
    size = page(backend)
    res = reserve(backend, 2 * size)
    pool = backend.create_pool(2, size)
    view = bytes_view(backend, res)
    for offsets, pages, what in [([0, 2 * size], [0, 1], "virtual"), ([0, 100], [0, 1], "virtual"),
                                 ([0, size], [0, 2], "physical"), ([-4096], [0], "virtual")]:
        with pytest.raises(ValueError, match=what):
            backend.map(res, pool, offsets, pages)
        if backend.zero_backing:
            assert int(view.sum()) == 0 and backend.committed_bytes(pool) == 0
    with pytest.raises(ValueError, match="2 virtual offsets but 1 physical"):
        backend.map(res, pool, [0, size], [0])
    with pytest.raises(TypeError):
        backend.map(res, pool, ["x"], [0])
    backend.map(res, pool, [0, size], [1, 0])  # nothing was left half-mapped in the way
    assert int(view.sum()) == 0


def test_reservation_and_pool_sizes_are_checked():
    with pytest.raises(ValueError, match="reservation size"):
        _native.Reservation(1000)
    with pytest.raises(ValueError, match="physical pool size"):
        _native.PhysicalFile(0)
    with pytest.raises(ValueError, match="at least one page"):
        HostBackend().create_pool(0, 4096)


def test_os_errors_carry_errno_text():
    res = _native.Reservation(4096)
    f = _native.PhysicalFile(4096)
    os.close(f.fd)  # the memfd closed underneath
    with pytest.raises(OSError, match=r"\[Errno 9\] mmap \(map page\) failed: Bad file descriptor"):
        _native.map_pages(res, f, 4096, [0], [0])


def test_unknown_device():
    with pytest.raises(ValueError, match="no VMM backend for device 'meta'"):
        get_backend("meta")


def test_dlpack_capsule_holds_its_owner_until_consumed_or_dropped():
    res = _native.Reservation(4096, True)
    base = sys.getrefcount(res)
    capsule = _native.dlpack(res, res.addr, res.nbytes, 1, 0)
    assert sys.getrefcount(res) == base + 1
    del capsule  # dropped unconsumed: the capsule's own destructor lets go
    assert sys.getrefcount(res) == base
    t = torch.from_dlpack(_native.dlpack(res, res.addr, res.nbytes, 1, 0))
    assert sys.getrefcount(res) == base + 1 and t.data_ptr() == res.addr
    del t
    assert sys.getrefcount(res) == base
    with pytest.raises(ValueError, match="positive size"):
        _native.dlpack(res, res.addr, 0, 1, 0)


MAP_LIMIT_SCRIPT = """
from vattn import _native
from vattn.backends import HostBackend
b = HostBackend(); page = 4096
n = 40000  # every other page: each mapped page and each hole is one mapping entry
res = b.reserve(2 * n * page, zero_backed=True); pool = b.create_pool(n, page)
offsets = [2 * i * page for i in range(n)]
try:
    b.map(res, pool, offsets, range(n))
except _native.MapLimitError as e:
    print("LIMIT", e)
view = b.tensor(res, __import__("torch").uint8, (res.nbytes,), (1,))
assert int(view.sum()) == 0, "a failed batch left pages mapped"
b.map(res, pool, offsets[:100], range(100))  # the process still maps fine
print("OK")
"""


def test_mapping_limit_is_a_clear_error():
    with open("/proc/sys/vm/max_map_count") as f:
        if int(f.read()) > 70000:
            pytest.skip("vm.max_map_count is above what this test exhausts")
    out = subprocess.run([sys.executable, "-c", MAP_LIMIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LIMIT" in out.stdout and "vm.max_map_count=" in out.stdout and out.stdout.strip().endswith("OK")


def test_there_is_one_backend_per_device():
    from vattn import CacheConfig, VirtualKVCache

    assert get_backend("cpu") is get_backend(torch.device("cpu")) is VirtualKVCache(CacheConfig(1, 1, 8)).backend
    with pytest.raises(ValueError, match="no VMM backend for device 'meta'"):
        get_backend("meta")


def mappings():
    """This process's mappings from /proc/self/smaps: (start, end, path or None, {field: value})."""
    found = []
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a header: range, perms, offset, dev, inode, path
            start, end = (int(a, 16) for a in fields[0].split("-"))
            found.append((start, end, fields[5] if len(fields) > 5 else None, {}))
        else:
            name, _, value = line.partition(":")
            found[-1][3][name] = value.strip()
    return found


def resident_kb(path) -> int:
    """Resident kB of this process's mappings of the file at `path`."""
    return sum(int(f["Rss"].split()[0]) for _, _, mapped, f in mappings() if mapped == str(path))


def test_pages_of_a_mapped_file_are_given_back_and_read_again(tmp_path):
    from vattn.backends.host import page_out_file_pages

    path = tmp_path / "weights"
    values = torch.arange(1 << 20, dtype=torch.float32)
    values.numpy().tofile(path)
    os.sync()  # clean pages: a file's dirty pages are written back before they can go
    mapped = torch.from_file(str(path), shared=False, size=values.numel())
    assert torch.equal(mapped, values) and resident_kb(path) >= 4000  # every page read in
    anonymous = values.clone()
    assert page_out_file_pages([anonymous]) == 0  # anonymous memory is left alone
    assert page_out_file_pages([mapped]) == mapped.numel() * 4  # page-aligned from the file's start
    assert resident_kb(path) < 1000
    assert torch.equal(mapped, values) and torch.equal(anonymous, values)  # read again from the file
    with pytest.raises(ValueError, match="negative"):
        _native.page_out(mapped.data_ptr(), -1)


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address` ({} where none does)."""
    return next((f for start, end, _, f in mappings() if start <= address < end), {})


def test_huge_pages_carve_aligned_tensors_that_outlive_the_carver():
    import gc

    from vattn.backends.host import HugePages

    pages = HugePages()
    small, wide = pages.empty(3, 5), pages.empty(7, dtype=torch.bfloat16)
    whole = pages.empty(HugePages.CHUNK // 4 + 3)  # past a chunk: one of its own, aligned to a huge page
    small.fill_(1.5), wide.fill_(2.0), whole.fill_(3.0)
    assert small.shape == (3, 5) and wide.dtype == torch.bfloat16 and whole.is_contiguous()
    assert small.data_ptr() % 64 == 0 and wide.data_ptr() == small.data_ptr() + 64
    assert whole.data_ptr() % HugePages.HUGE == 0 and pages.empty(0, 4).shape == (0, 4)
    assert "hg" in mapping_of(whole.data_ptr())["VmFlags"].split()  # advised for huge pages
    del pages
    gc.collect()
    assert small.sum() == 22.5 and wide.sum() == 14 and whole[-4:].sum() == 12  # still mapped
    address = whole.data_ptr()
    del whole
    gc.collect()
    assert mapping_of(address) == {}  # its chunk unmapped with its last tensor
