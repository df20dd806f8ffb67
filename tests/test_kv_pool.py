"""Several caches on one physical pool (`vattn.kv.shared`): the books, the policy, the mapping count, the
engines on it, and what it refuses."""
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import live
from vattn import CacheConfig, KVPool, VirtualKVCache

KiB = 1 << 10
CHUNK = 64 * KiB
# page_bytes 16 KiB (4 pages a chunk), 16 KiB in bfloat16 per head (4), 4 KiB interleaved (16; tokens straddle pages)
GEOMETRIES = [dict(num_layers=2, num_kv_heads=1, head_dim=16, dtype=torch.float32, layout="per_layer", max_seq_len=256),
              dict(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, layout="per_head", max_seq_len=1024),
              dict(num_layers=3, num_kv_heads=1, head_dim=32, dtype=torch.float16, layout="interleaved",
                   max_seq_len=160)]


def cache_on(member, geometry, max_num_seqs=4) -> VirtualKVCache:
    return VirtualKVCache(CacheConfig(**geometry, max_num_seqs=max_num_seqs, page_size=4 * KiB), member=member)


def write(cache, slot, start, n, seed):
    """`n` random tokens at `start` in every layer; [(k, v)] per layer."""
    c, g = cache.config, torch.Generator().manual_seed(seed)
    out = []
    for layer in range(c.num_layers):
        k, v = (torch.randn(1, n, c.num_kv_heads, c.head_dim, generator=g).to(c.dtype) for _ in "kv")
        cache.data.write(layer, [slot], [start], k, v)
        out.append((k[0], v[0]))
    return out


class PoolMachine(RuleBasedStateMachine):
    """Caches of different geometries on one pool of 4 chunks (each could fill it alone): every operation
    of each, and the limits."""

    geometries = GEOMETRIES[:2]

    def __init__(self):
        super().__init__()
        self.pool = KVPool(4 * CHUNK, chunk_size=CHUNK)
        self.names = [f"m{i}" for i in range(len(self.geometries))]
        self.caches = {n: cache_on(self.pool.add(n), g) for n, g in zip(self.names, self.geometries)}
        self.rows = {n: {} for n in self.names}  # slot -> [(K, V)] per layer of what it holds
        self.swapped = {n: [] for n in self.names}
        self.seed = 0

    def _seed(self):
        self.seed += 1
        return self.seed

    def _acting(self, name, change):
        """Run `change`; no other member is pushed below its floor, and refusals change nothing."""
        before, moves = {n: self.pool.members[n].held for n in self.names}, self.pool.moves
        result = change()
        if self.pool.moves > moves:
            event("chunks went from one model to another")
        for n, held in before.items():
            m = self.pool.members[n]
            if n != name and held >= m.floor:
                assert m.held >= m.floor, f"{n} was pushed below its floor by {name}"
        return result

    def _append(self, name, slot, n):
        c = self.caches[name]
        start = c.length(slot)
        n = min(n, c.capacity(slot) - start)
        if n > 0:
            new = write(c, slot, start, n, self._seed())
            self.rows[name][slot] = [(torch.cat([k0, k]), torch.cat([v0, v]))
                                     for (k0, v0), (k, v) in zip(self.rows[name][slot], new)]

    def _empty(self, name):
        c = self.caches[name].config
        return [(torch.zeros(0, c.num_kv_heads, c.head_dim, dtype=c.dtype),) * 2 for _ in range(c.num_layers)]

    @rule(data=st.data(), n=st.integers(1, 1024), filled=st.floats(0, 1))
    def allocate(self, data, n, filled):
        name = data.draw(st.sampled_from(self.names))
        c = self.caches[name]
        n = min(n, c.config.max_seq_len)
        expected = c.can_allocate(n)
        slot = self._acting(name, lambda: c.allocate(n))
        assert (slot is not None) == expected
        if slot is not None:
            self.rows[name][slot] = self._empty(name)
            self._append(name, slot, int(n * filled))

    @rule(data=st.data(), extra=st.integers(1, 512))
    def grow(self, data, extra):
        name = data.draw(st.sampled_from(self.names))
        c = self.caches[name]
        if not self.rows[name]:
            return
        slot = data.draw(st.sampled_from(sorted(self.rows[name])))
        target = min(c.config.max_seq_len, c.capacity(slot) + extra)
        expected = c.can_grow(slot, target)
        grown = self._acting(name, lambda: c.grow(slot, target))
        assert grown == expected
        if grown:
            self._append(name, slot, extra)

    @rule(data=st.data())
    def fork(self, data):
        name = data.draw(st.sampled_from(self.names))
        c = self.caches[name]
        sources = [s for s in self.rows[name] if c.length(s)]
        if not sources:
            return
        src = data.draw(st.sampled_from(sorted(sources)))
        n = c.length(src)
        child = self._acting(name, lambda: c.fork(src, n))
        if child is not None:
            self.rows[name][child] = [(k.clone(), v.clone()) for k, v in self.rows[name][src]]

    @rule(data=st.data())
    def free(self, data):
        name = data.draw(st.sampled_from(self.names))
        if self.rows[name]:
            slot = data.draw(st.sampled_from(sorted(self.rows[name])))
            self.caches[name].free(slot)
            del self.rows[name][slot]

    @rule(data=st.data(), n=st.integers(1, 1024))
    def peak(self, data, n):
        """A model's traffic peaks: it takes slots of `n` tokens while it finds room."""
        name = data.draw(st.sampled_from(self.names))
        c = self.caches[name]
        n = min(n, c.config.max_seq_len)
        while (slot := self._acting(name, lambda: c.allocate(n))) is not None:
            self.rows[name][slot] = self._empty(name)
            self._append(name, slot, n)

    @rule(data=st.data())
    def quiet(self, data):
        """A model's traffic ends: every slot of it goes idle."""
        name = data.draw(st.sampled_from(self.names))
        for slot in sorted(self.rows[name]):
            self.caches[name].free(slot)
        self.rows[name].clear()

    @rule(data=st.data())
    def swap_out(self, data):
        name = data.draw(st.sampled_from(self.names))
        if self.rows[name]:
            slot = data.draw(st.sampled_from(sorted(self.rows[name])))
            self.swapped[name].append((self.caches[name].swap_out(slot), self.rows[name].pop(slot)))

    @rule(data=st.data())
    def swap_in(self, data):
        name = data.draw(st.sampled_from(self.names))
        if self.swapped[name]:
            i = data.draw(st.integers(0, len(self.swapped[name]) - 1))
            handle, rows = self.swapped[name][i]
            slot = self._acting(name, lambda: self.caches[name].swap_in(handle))
            if slot is not None:
                self.rows[name][slot] = rows
                del self.swapped[name][i]

    @rule(data=st.data())
    def trim(self, data):
        name = data.draw(st.sampled_from(self.names))
        self.caches[name].trim()

    @rule(data=st.data(), floor=st.integers(0, 3), cap=st.integers(0, 4))
    def set_limits(self, data, floor, cap):
        name = data.draw(st.sampled_from(self.names))
        before = self.pool.split()
        try:
            self._acting(name, lambda: self.pool.set_limits(name, floor * CHUNK, cap * CHUNK))
        except ValueError:
            assert self.pool.split() == before  # a refusal changes nothing

    @invariant()
    def books_balance(self):
        self.pool.check()
        for c in self.caches.values():
            c.check()
        assert self.pool.free_chunks + sum(m.held for m in self.pool.members.values()) == self.pool.num_chunks

    @invariant()
    def rows_intact(self):
        for name, slots in self.rows.items():
            c = self.caches[name]
            for slot, layers in slots.items():
                for layer, (k, v) in enumerate(layers):
                    got_k, got_v = live(c, slot, layer)
                    assert torch.equal(got_k, k) and torch.equal(got_v, v), f"{name} slot {slot} layer {layer}"


class ThreeModels(PoolMachine):
    geometries = GEOMETRIES


MACHINE_SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestTwoCachesOnOnePool = PoolMachine.TestCase
TestTwoCachesOnOnePool.settings = MACHINE_SETTINGS
TestThreeCachesOnOnePool = ThreeModels.TestCase
TestThreeCachesOnOnePool.settings = MACHINE_SETTINGS


# ------------------------------------------------------------ the policy


def two(chunks=6, floor=0, cap=None, geometry=GEOMETRIES[0]):
    """Caches a and b (4 pages a chunk, 4 pages a slot) on a pool of `chunks`; a's floor and cap in chunks."""
    pool = KVPool(chunks * CHUNK, chunk_size=CHUNK)
    a = cache_on(pool.add("a", floor * CHUNK, None if cap is None else cap * CHUNK), geometry)
    b = cache_on(pool.add("b"), geometry)
    return pool, a, b


def held(pool):
    return {n: m.held for n, m in pool.members.items()}


def test_free_chunks_go_first_and_a_quiet_model_s_idle_pages_stay():
    pool, a, b = two()
    slot = a.allocate(256)
    a.free(slot)  # one chunk idle in a
    assert b.allocate(256) is not None
    assert held(pool) == {"a": 1, "b": 1} and a.stats().pages_idle == 4


def test_a_model_reclaims_its_own_idle_pages_before_taking_another_s():
    pool, a, b = two(chunks=2)
    a.free(a.allocate(256))
    b.free(b.allocate(256))
    assert b.allocate(256) is not None
    assert held(pool) == {"a": 1, "b": 1} and a.stats().pages_idle == 4


def test_idle_pages_of_a_quiet_model_reach_the_busy_one_in_the_call_that_asks():
    pool, a, b = two(chunks=4)
    slots = [a.allocate(256) for _ in range(4)]
    for s in slots:
        a.free(s)
    assert held(pool) == {"a": 4, "b": 0} and pool.free_chunks == 0
    got = [b.allocate(256) for _ in range(3)]
    assert None not in got and held(pool) == {"a": 1, "b": 3}
    a.check(), b.check(), pool.check()


def test_others_floors_are_kept_and_running_requests_keep_their_pages():
    pool, a, b = two(chunks=4, floor=2)
    first = [a.allocate(256) for _ in range(3)]
    a.free(first[0])
    a.free(first[1])  # a: 3 chunks, 2 idle, floor 2
    assert b.allocate(256) is not None  # the free chunk
    assert b.allocate(256) is not None  # one idle chunk of a, above its floor
    assert held(pool) == {"a": 2, "b": 2}
    assert b.allocate(256) is None  # a's last idle chunk is its floor; its running slot is its own
    assert a.length(first[2]) == 0 and a.mapped_pages(first[2]) == 4


def test_unmet_floors_are_kept_free_for_their_model():
    pool, a, b = two(chunks=4, floor=3)
    assert b.allocate(256) is not None and b.allocate(256) is None  # three chunks wait for a
    assert b.available_pages() == 0 and held(pool) == {"a": 0, "b": 1}
    assert [a.allocate(256) for _ in range(3)].count(None) == 0


def test_a_cap_bounds_a_model_and_lowering_it_gives_idle_chunks_back():
    pool, a, b = two(chunks=6, cap=2)
    assert [a.allocate(256) for _ in range(3)] == [0, 1, None]
    a.free(1)
    pool.set_limits("a", cap=CHUNK)
    assert held(pool) == {"a": 1, "b": 0} and pool.free_chunks == 5
    with pytest.raises(ValueError, match="running requests use 1 chunks"):
        pool.set_limits("a", cap=0)
    a.check(), pool.check()


def test_a_cache_that_goes_gives_its_chunks_back():
    pool, a, b = two(chunks=3)
    b.allocate(256), b.allocate(256)
    del b
    import gc

    gc.collect()
    assert pool.free_chunks == 3 and held(pool) == {"a": 0, "b": 0}
    assert a.allocate(256) is not None


def maps_in(reservation) -> int:
    """Mappings the process has inside a reservation (from /proc/self/maps)."""
    lo, hi, n = reservation.addr, reservation.addr + reservation.nbytes, 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        n += lo <= start and end <= hi
    return n


@pytest.mark.parametrize("count", [2, 3])
def test_mappings_stay_one_per_buffer_and_chunk_while_models_interleave_their_growth(count):
    """Each model grows one slot a page at a time, in turn, until the pool is full: its mappings never pass
    `num_buffers` × (2 + the chunks its pages lie in) plus the reservation's unmapped rest, and the
    process's mapping limit stops nobody."""
    geometry = dict(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, layout="per_head",
                    max_seq_len=4096)  # 16 buffers of 4 KiB pages: 64 KiB a page, 4 a chunk
    pool = KVPool(12 * 4 * 64 * KiB, chunk_size=4 * 64 * KiB)
    caches = [cache_on(pool.add(f"m{i}"), geometry, max_num_seqs=1) for i in range(count)]
    slots = [c.allocate(64) for c in caches]
    tokens = [64] * count
    while True:
        grown = False
        for i, c in enumerate(caches):
            if c.grow(slots[i], tokens[i] + 64):
                tokens[i] += 64
                grown = True
        if not grown:
            break
    assert pool.free_chunks == 0 and sum(tokens) == 12 * 4 * 64
    for c in caches:
        pages, buffers = c.mapped_pages(0), c.config.num_buffers
        chunks = -(-pages // c.table.member.per_chunk)
        assert c.map_limit_hits == 0
        assert c.table.entries <= 2 + chunks
        assert maps_in(c.storage.reservation) <= buffers * (2 + chunks) + 1


# ------------------------------------------------------------ bad input


def test_the_pool_refuses_bad_limits_and_changes_nothing():
    pool, a, b = two(chunks=4, floor=2)
    before = pool.split()
    with pytest.raises(ValueError, match="floors would add up to 5 chunks .* the pool has 4"):
        pool.set_limits("b", floor=3 * CHUNK)
    with pytest.raises(ValueError, match=r"a's cap \(1 chunks\) is below its floor \(2 chunks\)"):
        pool.set_limits("a", cap=CHUNK)
    with pytest.raises(ValueError, match="no member 'c'"):
        pool.set_limits("c", floor=0)
    with pytest.raises(ValueError, match="byte count"):
        pool.set_limits("a", floor=-1)
    with pytest.raises(ValueError, match="floors would add up"):
        pool.add("c", floor=3 * CHUNK)
    with pytest.raises(ValueError, match="member named 'a' already"):
        pool.add("a")
    assert pool.split() == before and sorted(pool.members) == ["a", "b"]


def test_a_cache_the_pool_cannot_hold_is_refused():
    pool = KVPool(16 * CHUNK, chunk_size=CHUNK)
    big = dict(GEOMETRIES[0], num_layers=64)  # 128 buffers of 4 KiB: a page (512 KiB) is larger than a chunk
    with pytest.raises(ValueError, match="do not tile the pool's chunks"):
        cache_on(pool.add("big"), big)
    member = pool.add("a")
    keep = cache_on(member, GEOMETRIES[0])
    with pytest.raises(ValueError, match="already has a cache"):
        cache_on(member, GEOMETRIES[0])
    with pytest.raises(ValueError, match="at least one chunk"):
        KVPool(CHUNK - 1, chunk_size=CHUNK)
    assert keep.allocate(256) is not None and pool.free_chunks == 15


# ------------------------------------------------------------ engines on one pool

SMOLLM2_GROUP = 180 * 8192  # a SmolLM2 page in float32: 30 layers × K/V × 3 heads of 8 KiB


def greedy(n=24):
    from vattn import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def outputs(engines_and_prompts, steps_in_turn=True):
    """Each engine's outputs for its prompts, the engines stepped in turn."""
    for engine, prompts in engines_and_prompts:
        for i, p in enumerate(prompts):
            engine.add_request(p, greedy(), f"r{i}")
    done = [{} for _ in engines_and_prompts]
    while any(e.has_unfinished_requests() for e, _ in engines_and_prompts):
        for k, (engine, _) in enumerate(engines_and_prompts):
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[k][out.request_id] = out.outputs[0].token_ids
    return [[d[f"r{i}"] for i in range(len(p))] for d, (_, p) in zip(done, engines_and_prompts)]


def test_two_models_on_one_pool_answer_as_each_does_alone():
    """SmolLM2 and a tiny Llama share 4 chunks of two SmolLM2 pages: the tiny model's idle chunk goes to
    SmolLM2, which still preempts; every answer equals the model's alone."""
    from tiny_models import tiny_model
    from vattn.engine import EngineConfig, LLMEngine
    from vattn.models import load_model

    model, tokenizer = load_model(dtype=torch.float32)
    tiny = tiny_model("llama", "sdpa")
    torch.manual_seed(0)
    long_prompts = [torch.randint(1, 1000, (n,)).tolist() for n in (40, 50, 60, 45)]
    short = [torch.randint(1, tiny.config.vocab_size, (n,)).tolist() for n in (5, 9)]
    alone = outputs([(LLMEngine(model, tokenizer), long_prompts), (LLMEngine(tiny), short)])

    pool = KVPool(4 * 2 * SMOLLM2_GROUP, chunk_size=2 * SMOLLM2_GROUP)
    small = LLMEngine(tiny, config=EngineConfig(kv_pool=pool.add("tiny")))
    assert outputs([(small, short)])[0] == alone[1]  # the tiny model now holds an idle chunk
    assert pool.members["tiny"].held == 1
    smol = LLMEngine(model, tokenizer, EngineConfig(kv_pool=pool.add("smollm2")))
    shared = outputs([(smol, long_prompts), (small, short)])
    assert shared == alone
    assert pool.moves > 0 and smol.scheduler.preemptions > 0  # a chunk went across, and memory still ran short
    pool.check()


def test_a_quiet_model_s_idle_chunks_serve_the_busy_one_s_first_step():
    """Two tiny models on two chunks (a page of 128 tokens each): the quiet one's idle pages hold the whole
    pool, and the busy one's request runs in the very step after it asked."""
    from tiny_models import tiny_model
    from vattn.engine import EngineConfig, LLMEngine

    pool = KVPool(2 * CHUNK, chunk_size=CHUNK)
    quiet = LLMEngine(tiny_model("llama", "sdpa"), config=EngineConfig(kv_pool=pool.add("quiet")))
    busy = LLMEngine(tiny_model("llama", "sdpa", num_hidden_layers=1), config=EngineConfig(kv_pool=pool.add("busy")))
    outputs([(quiet, [[5] * 100, [6] * 100])])
    assert pool.members["quiet"].held == 2 and quiet.kv.stats().pages_idle == 2
    busy.add_request([7] * 20, greedy(4), "asks")
    (first,) = busy.step()
    assert len(first.outputs[0].token_ids) == 1 and pool.members["quiet"].held == 1
    pool.check()


def test_engines_refuse_a_pool_they_cannot_use():
    from tiny_models import tiny_model
    from vattn.engine import EngineConfig, LLMEngine

    pool = KVPool(CHUNK, chunk_size=CHUNK)  # one page of the tiny model: 128 tokens
    member = pool.add("a")
    with pytest.raises(ValueError, match="must be a vattn.PoolMember"):
        EngineConfig(kv_pool="a")
    with pytest.raises(ValueError, match="memory_budget and kv_pool exclude each other"):
        EngineConfig(kv_pool=member, memory_budget=CHUNK)
    with pytest.raises(ValueError, match="serves the virtual cache"):
        EngineConfig(kv_pool=member, kv_cache="paged")
    engine = LLMEngine(tiny_model("llama", "sdpa"), config=EngineConfig(kv_pool=member))
    with pytest.raises(ValueError, match="may need 2 pages; the memory budget holds 1"):  # more than the whole pool
        engine.add_request([5] * 150, greedy(50), "too-long")
    assert not engine.has_unfinished_requests() and member.held == 0
