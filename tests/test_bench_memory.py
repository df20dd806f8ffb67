"""The memory replay: static policies by hand, invariants of every policy, and the command end to end."""
import json

import pytest

from vattn.bench import memory
from vattn.cli import main

TINY = memory.Geometry(layers=2, kv_heads=1, head_dim=64, budget=1 << 20)  # 512 bytes a token (bf16)


def test_orca_max_on_a_hand_computed_trace():
    # three requests reserving 8 one-byte tokens each in 16 bytes: two fit; 4 tokens a step
    tally = memory.replay_static("orca_max", [(3, 2), (2, 3), (4, 1)], token_bytes=1, budget=16, max_num_seqs=4,
                                 max_num_batched_tokens=4, max_seq_len=8)
    # step 1: r0 prefills 3, r1 1 of 2; step 2: r0 decodes and ends, r1 ends its prompt;
    # step 3: r2 takes r0's range (prefill 3 of 4), r1 decodes; step 4: both end
    assert (tally.steps, tally.completed, tally.peak_concurrency) == (4, 3, 2)
    assert (tally.live, tally.committed, tally.reserved, tally.internal, tally.external) == (12, 40, 13, 15, 0)
    row = tally.row()
    assert row["utilization"] == pytest.approx(0.3)
    assert row["waste"] == pytest.approx({"reserved": 13 / 40, "internal": 15 / 40, "external": 0})


def test_static_reservations_and_first_fit():
    assert [memory.reservation(p, 100, 2048) for p in memory.STATIC] == [2048, 128, 100]
    assert memory.reservation("orca_pow2", 1500, 1024) == 1024  # never past max_seq_len
    arena = [(6, 10), (0, 4)]
    assert memory.first_fit(arena, 2, 12) == 4  # the hole between the two
    assert memory.first_fit(arena, 3, 13) == 10  # after them
    assert memory.first_fit(arena, 3, 12) is None


def test_oracle_strands_memory_between_reservations():
    # 10 bytes: r0 takes [0, 3) and ends in step 1, r1 takes [3, 8) for four steps; r2 (5) fits
    # neither the 3-byte hole nor the 2 bytes at the end, so 3 bytes are stranded in steps 2-4
    tally = memory.replay_static("orca_oracle", [(2, 1), (1, 4), (1, 4)], token_bytes=1, budget=10, max_num_seqs=4,
                                 max_num_batched_tokens=16, max_seq_len=8)
    assert tally.completed == 3 and tally.external == 3 * 3


def test_a_request_longer_than_max_seq_len_is_refused():
    with pytest.raises(ValueError, match="request 1 needs 300 tokens; max_seq_len is 256"):
        memory.replay("paged_16", [(3, 2), (200, 100)], TINY, budget=1 << 20, max_seq_len=256)


def test_a_request_larger_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="reserves 2048 bytes; the budget holds 1000"):
        memory.replay_static("orca_max", [(3, 2)], token_bytes=1, budget=1000, max_num_seqs=4,
                             max_num_batched_tokens=16, max_seq_len=2048)


@pytest.mark.parametrize("policy", ["orca_pow2", "paged_16", "vattn_interleaved_64k", "vattn_per_layer_64k_nodefer"])
def test_every_request_completes_and_committed_covers_live(policy):
    trace = memory.alpaca_trace(40, seed=3)
    tally, counters = memory.replay(policy, trace, TINY, budget=512 << 10, max_num_seqs=16,
                                    max_num_batched_tokens=64, max_seq_len=512)
    assert tally.completed == len(trace)
    assert all(0 <= u <= 1 for u in tally.timeline) and 0 < tally.live <= tally.committed
    if policy.startswith("vattn"):
        assert counters["map_calls"] > 0
    if policy.endswith("nodefer"):  # every finished request's pages are unmapped at once
        deferred, _ = memory.replay(policy.removesuffix("_nodefer"), trace, TINY, budget=512 << 10, max_num_seqs=16,
                                    max_num_batched_tokens=64, max_seq_len=512)
        assert deferred.completed == tally.completed


def test_deferred_reclamation_saves_map_calls():
    trace = memory.alpaca_trace(60, seed=4)
    calls = {p: memory.replay(p, trace, TINY, budget=512 << 10, max_num_seqs=8, max_num_batched_tokens=64,
                              max_seq_len=512)[1]["map_calls"] for p in ("vattn_per_layer_64k", "vattn_per_layer_64k_nodefer")}
    assert calls["vattn_per_layer_64k"] < calls["vattn_per_layer_64k_nodefer"]


def test_policy_names_parse():
    assert memory.engine_settings("paged_32") == dict(kv_cache="paged", block_size=32)
    assert memory.engine_settings("vattn_interleaved_2m") == dict(layout="interleaved", page_size=2 << 20,
                                                                  deferred_reclamation=True)
    assert memory.engine_settings("vattn_per_layer_256k_nodefer") == dict(layout="per_layer", page_size=256 << 10,
                                                                          deferred_reclamation=False)


def test_bench_memory_command(tmp_path):
    out = tmp_path / "memory.json"
    main(["bench", "memory", "--traces", "alpaca", "--models", "smollm2-135m", "--requests", "30", "--budget", "64MiB",
          "--policies", "orca_max", "paged_16", "vattn_interleaved_64k", "--json", str(out), "--plot", str(tmp_path)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["orca_max", "paged_16", "vattn_interleaved_64k"]
    for r in rows:
        assert {"policy", "trace", "model", "utilization", "peak_concurrency", "steps", "map_calls", "waste"} <= set(r)
        assert set(r["waste"]) == {"reserved", "internal", "external"} and r["completed"] == 30
    assert (tmp_path / "memory_alpaca_smollm2-135m.png").stat().st_size > 0
