"""The backend contract, on the real host backend."""
import gc
import os
import subprocess
import sys

import pytest
import torch

from vattn import _native
from vattn.backends import HostBackend, get_backend

BACKENDS = [HostBackend]
PAGE_SIZES = [4096, 64 << 10, 256 << 10, 2 << 20]


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(request):
    return request.param()


def bytes_view(backend, reservation):
    return backend.tensor(reservation, torch.uint8, (reservation.nbytes,), (1,))


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda s: f"{s >> 10}k")
def test_map_write_unmap(backend, page_size):
    res = backend.reserve(4 * page_size, zero_backed=True)
    pool = backend.create_pool(4, page_size)
    view = bytes_view(backend, res)
    assert int(view.sum()) == 0  # zero-backed: unmapped pages read as zeros
    backend.map(res, pool, [page_size, 3 * page_size], [2, 0])
    view[page_size:page_size + 5] = 7
    view[3 * page_size] = 9
    backend.unmap(res, pool, [page_size, 3 * page_size])
    assert int(view.sum()) == 0
    # the bytes live in the physical pages: map them elsewhere and read them back
    backend.map(res, pool, [0, 2 * page_size], [2, 0])
    assert view[:5].tolist() == [7] * 5 and int(view[2 * page_size]) == 9
    backend.unmap(res, pool, [0, 2 * page_size])


def test_one_page_at_two_addresses_is_shared(backend):
    size = 64 << 10
    res = backend.reserve(2 * size, zero_backed=True)
    pool = backend.create_pool(1, size)
    backend.map(res, pool, [0, size], [0, 0])
    view = bytes_view(backend, res)
    view[10] = 42
    assert int(view[size + 10]) == 42


def test_release_returns_memory_and_zeroes(backend):
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


def test_untouched_mapped_pages_cost_nothing(backend):
    size = 2 << 20
    res = backend.reserve(64 * size)
    pool = backend.create_pool(64, size)
    backend.map(res, pool, [j * size for j in range(64)], range(64))
    assert backend.committed_bytes(pool) == 0
    bytes_view(backend, res)[5 * size] = 1
    assert backend.committed_bytes(pool) == backend.granularity  # one OS page touched


def test_tensor_views_keep_the_reservation_alive(backend):
    res = backend.reserve(1 << 20, zero_backed=True)
    t = backend.tensor(res, torch.float32, (4, 8), (16, 1), offset=4)
    del res
    gc.collect()
    assert float(t.sum()) == 0.0  # still readable: the range was not released under the view


def test_tensor_cannot_reach_past_the_reservation(backend):
    res = backend.reserve(4096)
    with pytest.raises(RuntimeError):
        backend.tensor(res, torch.float32, (2048,), (1,))


@pytest.mark.parametrize("bad", [0, 1000, 4096 + 1])
def test_bad_page_size(backend, bad):
    with pytest.raises(ValueError, match="page_size must be a positive multiple"):
        backend.create_pool(1, bad)


def test_bad_offsets_map_nothing(backend):
    size = 64 << 10
    res = backend.reserve(2 * size, zero_backed=True)
    pool = backend.create_pool(2, size)
    view = bytes_view(backend, res)
    for offsets, pages, what in [([0, 2 * size], [0, 1], "virtual"), ([0, 100], [0, 1], "virtual"),
                                 ([0, size], [0, 2], "physical"), ([-4096], [0], "virtual")]:
        with pytest.raises(ValueError, match=what):
            backend.map(res, pool, offsets, pages)
        assert int(view.sum()) == 0 and backend.committed_bytes(pool) == 0
    with pytest.raises(ValueError, match="2 virtual offsets but 1 physical"):
        backend.map(res, pool, [0, size], [0])
    with pytest.raises(TypeError):
        backend.map(res, pool, ["x"], [0])


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
