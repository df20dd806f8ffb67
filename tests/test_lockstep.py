"""Rank 0's cache calls replayed on another rank's cache (`vattn.distributed.lockstep`),
in one process: every kind of call, the same books after, and a replay
that comes out otherwise refused."""
import pytest

from conftest import fill, make_cache
from vattn.distributed.lockstep import Diverged, RecordingKV, Replica, books
from vattn.kv.manager import KVCacheManager

PROMPT = [1, 2, 3, 4] * 24  # 96 tokens: two full 42-token pages and a tail


class Seq:  # sequences are keyed by identity, as the engine's are
    pass


def managers(pages=12):
    return [KVCacheManager(make_cache("per_layer", max_num_seqs=4, max_seq_len=200, pages=pages)) for _ in "ab"]


def drive(kv: RecordingKV, replica: KVCacheManager) -> list[tuple]:
    """A scheduler's life in miniature: admit, compute, a prefix hit, n = 3,
    swap, discard, free; the replica replays the log where a forward would
    have run, and its forward writes the same tokens.  Returns the rest of the log."""
    a, b, c, d, e = (Seq() for _ in range(5))
    assert kv.allocate(a, PROMPT, 100) == 0
    Replica(replica).replay(kv.take())
    for cache in (kv.cache, replica.cache):  # the forward
        fill(cache, 0, len(PROMPT))
    kv.cache_tokens(a, PROMPT, len(PROMPT))
    assert kv.allocate(b, PROMPT + [9], 10) > 0  # a prefix hit: a's full pages, shared
    assert kv.fork(a, c, 90)
    assert kv.allocate_slots({a: 120})
    kv.map_ahead({a: 121, b: 97})
    swapped = kv.swap_out(c)
    assert kv.swap_in(d, swapped)
    kv.free(b)
    again = kv.swap_out(d)
    kv.discard(again)
    assert kv.allocate(e, [5] * 30, 30) == 0
    kv.free(a)
    return kv.take()


def test_a_replayed_log_leaves_the_same_books():
    here, there = managers()
    recorded = RecordingKV(here)
    ops = drive(recorded, there)
    assert {name for name, _, _ in ops} == {"allocate", "cache_tokens", "fork", "allocate_slots", "map_ahead",
                                            "swap_out", "swap_in", "free", "discard"}
    assert recorded.take() == []  # taken once
    Replica(there).replay(ops)
    assert books(there) == books(here)
    here.check()
    there.check()


def test_a_replay_that_answers_otherwise_is_refused():
    here, _ = managers()
    recorded = RecordingKV(here)
    assert recorded.allocate(Seq(), PROMPT, 100) == 0
    smaller = KVCacheManager(make_cache("per_layer", max_num_seqs=4, max_seq_len=200, pages=1))
    with pytest.raises(Diverged, match=r"allocate\(0, .* answered None here, 0 on rank 0"):
        Replica(smaller).replay(recorded.take())
