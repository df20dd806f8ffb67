import pytest

from vattn import PagePool


def test_allocate_retain_release():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.retain([0, 1])
    assert pool.num_shared == 2
    assert pool.release([0, 1, 2]) == [2]
    assert pool.num_shared == 0 and pool.num_free == 2
    assert sorted(pool.release([0, 1])) == [0, 1]
    assert pool.num_free == 4 and pool.refs == [0] * 4


def test_lowest_pages_first():
    pool = PagePool(8)
    pool.allocate(5)
    pool.release([1, 3])
    assert pool.allocate(2) == [1, 3]


def test_misuse_leaves_pool_unchanged():
    pool = PagePool(3)
    pool.allocate(1)
    before = (list(pool.refs), pool.free_pages(), pool.num_shared)
    with pytest.raises(ValueError, match="is free"):
        pool.retain([0, 1])
    with pytest.raises(ValueError, match="cannot drop 2"):
        pool.release([0, 0])
    with pytest.raises(ValueError, match="cannot allocate -1"):
        pool.allocate(-1)
    assert (list(pool.refs), pool.free_pages(), pool.num_shared) == before
    with pytest.raises(ValueError):
        PagePool(0)
