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


def test_a_new_run_takes_the_middle_of_the_widest_free_run():
    pool = PagePool(20)
    assert pool.allocate(4) == [0, 1, 2, 3]  # the widest run begins the pool: its start
    assert pool.allocate(2) == [11, 12]  # free 4..19: the middle, leaving 4..10 to grow into
    assert pool.allocate(3) == [6, 7, 8]  # free 4..10 and 13..19: the lower of the widest
    assert pool.allocate(30) is None and pool.num_free == 11


def test_a_slot_grows_into_the_pages_after_its_last_then_elsewhere():
    pool = PagePool(20)
    a, b = pool.allocate(4), pool.allocate(2)
    assert pool.allocate(3, after=a[-1]) == [4, 5, 6]
    assert pool.allocate(2, after=b[-1]) == [13, 14]
    assert pool.allocate(6, after=6) == [7, 8, 9, 10, 16, 17]  # up to b's pages, then the middle of 15..19
    assert pool.free_pages() == [15, 18, 19]


def test_without_spread_the_lowest_pages_go_first():
    pool = PagePool(8, spread=False)
    pool.allocate(5)
    pool.release([1, 3])
    assert pool.allocate(2) == [1, 3]
    pool.release([2])
    assert pool.allocate(2, after=1) == [2, 5]


def test_a_slot_of_a_decoding_batch_keeps_its_pages_in_few_runs():
    """Eight slots growing a page each in turn: with the lowest pages first each
    page would start a run of its own."""
    pool = PagePool(256)
    tables = [pool.allocate(4) for _ in range(8)]
    for _ in range(12):
        for t in tables:
            t += pool.allocate(1, after=t[-1])
    runs = [1 + sum(b != a + 1 for a, b in zip(t, t[1:])) for t in tables]
    assert max(runs) <= 2, runs


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
