"""Random sequences of cache operations against a model of what each slot holds."""
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import make_cache, physical_bytes, live

MAX_SEQ = 120


class CacheMachine(RuleBasedStateMachine):
    layout = "per_layer"
    budget = 6  # page groups: tight, so pressure, reclaim and failures happen
    block_size = 16  # paged only

    geometry = {}

    def __init__(self):
        super().__init__()
        self.cache = make_cache(self.layout, max_num_seqs=4, max_seq_len=MAX_SEQ, pages=self.budget,
                                block_size=self.block_size, **self.geometry)
        self.c = self.cache.config
        self.model: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # slot -> (K, V) per layer
        self.swapped = []  # (handle, model)
        self.left = {}  # idle slot -> what its last owner wrote (it may resume it)
        self.seed = 0

    def empty(self):
        shape = (0, self.c.num_kv_heads, self.c.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(self.c.num_layers)]

    def active(self, data):
        """An active slot, preferring one that holds tokens; None if there is none."""
        if not self.model:
            return None
        return data.draw(st.sampled_from(sorted(self.model, key=lambda s: -self.model[s][0][0].shape[0])))

    @rule(n=st.integers(1, MAX_SEQ), filled=st.floats(0, 1))
    def allocate(self, n, filled):
        expected = self.cache.can_allocate(n)
        slot = self.cache.allocate(n)
        assert (slot is not None) == expected
        event("allocate", "ok" if slot is not None else "full")
        if slot is not None:
            assert slot not in self.model
            self.left.pop(slot, None)
            self.model[slot] = self.empty()
            self.write(slot, int(n * filled))

    @rule(data=st.data(), n=st.integers(1, MAX_SEQ))
    def resume(self, data, n):
        """An idle slot's next owner keeps a prefix of what the last one wrote."""
        if not self.left:
            return
        slot = data.draw(st.sampled_from(sorted(self.left)))
        written = self.left[slot][0][0].shape[0]
        most = min(n, written, self.cache.retained(slot))
        keep = data.draw(st.sampled_from([most, most // 2, 0]))
        if self.cache.allocate(n, slot=slot, resume=keep) is None:
            return
        event("resume", "kept tokens" if keep else "kept nothing")
        self.model[slot] = [(k[:keep].clone(), v[:keep].clone()) for k, v in self.left.pop(slot)]

    @rule(data=st.data())
    def shrink(self, data):
        slot = self.active(data)
        if slot is None:
            return
        self.cache.shrink([slot])
        assert self.cache.mapped_pages(slot) == self.c.pages_for(self.cache.capacity(slot))

    @rule(data=st.data(), t=st.integers(1, 30))
    def append(self, data, t):
        slot = self.active(data)
        if slot is None:
            return
        n = self.model[slot][0][0].shape[0] + t
        if n <= MAX_SEQ and self.cache.grow(slot, n):
            self.write(slot, t)

    def write(self, slot, t):
        """Append `t` random tokens in every layer, in the cache and in the model."""
        if t == 0:
            return
        length = self.model[slot][0][0].shape[0]
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        for layer in range(self.c.num_layers):
            k, v = (torch.randn(1, t, self.c.num_kv_heads, self.c.head_dim, generator=g) for _ in "kv")
            self.cache.data.write(layer, [slot], [length], k, v)
            K, V = self.model[slot][layer]
            self.model[slot][layer] = (torch.cat([K, k[0]]), torch.cat([V, v[0]]))

    @rule(data=st.data(), n=st.integers(1, MAX_SEQ))
    def grow(self, data, n):
        slot = self.active(data)
        if slot is None:
            return
        expected = self.cache.can_grow(slot, n)
        assert self.cache.grow(slot, n) == expected
        if expected:
            assert self.cache.capacity(slot) >= n

    @rule(data=st.data(), frac=st.floats(0.01, 1.0), into_new=st.booleans())
    def share(self, data, frac, into_new):
        src = self.active(data)
        if src is None or not self.model[src][0][0].shape[0]:
            return
        n = max(1, int(self.model[src][0][0].shape[0] * frac))
        if into_new:
            dst = self.cache.fork(src, n)
            if dst is None:
                return
        else:
            others = sorted(set(self.model) - {src})
            if not others:
                return
            dst = data.draw(st.sampled_from(others))
            if not self.cache.share(src, dst, n):
                return
        event("share", "into a new slot" if into_new else "into a slot")
        self.left.pop(dst, None)
        self.model[dst] = [(k[:n].clone(), v[:n].clone()) for k, v in self.model[src]]

    @rule(data=st.data())
    def trade(self, data):
        """Several slots take each other's prefixes at once, like beams."""
        if len(self.model) < 2:
            return
        dsts = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))
        srcs = [data.draw(st.sampled_from(sorted(self.model))) for _ in dsts]
        n = min(self.model[s][0][0].shape[0] for s in srcs)
        if n == 0:
            return
        if self.cache.share_many(dict(zip(dsts, srcs)), n):
            event("share_many")
            moved = {d: [(k[:n].clone(), v[:n].clone()) for k, v in self.model[s]] for d, s in zip(dsts, srcs)}
            self.model.update(moved)

    @rule(data=st.data())
    def free(self, data):
        slot = self.active(data)
        if slot is None:
            return
        self.cache.free(slot)
        self.left[slot] = self.model.pop(slot)

    @rule(data=st.data())
    def swap_out(self, data):
        slot = self.active(data)
        if slot is None:
            return
        self.swapped.append((self.cache.swap_out(slot), self.model.pop(slot)))

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        i = data.draw(st.integers(0, len(self.swapped) - 1))
        handle, model = self.swapped[i]
        slot = self.cache.swap_in(handle)
        event("swap in", "ok" if slot is not None else "full")
        if slot is not None:
            self.swapped.pop(i)
            self.left.pop(slot, None)
            self.model[slot] = model

    @rule()
    def trim(self):
        event("trim", "reclaimed" if self.cache.trim() else "nothing idle")
        assert self.cache.stats().pages_idle == 0

    @invariant()
    def bookkeeping(self):
        self.cache.check()  # references == mappings, nothing lost or double-owned
        st_ = self.cache.stats()
        assert st_.pages_free + st_.pages_mapped == st_.pages_total
        assert sorted(self.cache.active_slots) == sorted(self.model)

    @invariant()
    def data_intact(self):
        for slot, layers in self.model.items():
            for layer, (k, v) in enumerate(layers):
                ck, cv = live(self.cache, slot, layer)
                assert torch.equal(ck, k) and torch.equal(cv, v), f"slot {slot} layer {layer} changed"

    @invariant()
    def mapped_where_the_books_say(self):
        """Each slot's first page reads the same through the slot and through the memfd."""
        size = self.c.page_size
        for slot in self.model:
            pages = self.cache.block_table(slot)
            for buffer in (0, self.c.num_buffers - 1):
                view = self.cache.storage.bytes[buffer, slot, :size]
                assert torch.equal(view, physical_bytes(self.cache, pages[0], buffer))


class PagedMachine(CacheMachine):
    layout = "paged"
    budget = 14
    block_size = 5

    @invariant()
    def mapped_where_the_books_say(self):
        """Each slot's first token of layer 0 sits in the pool row its block table names."""
        for slot, layers in self.model.items():
            if len(layers[0][0]):
                row = self.cache.block_table(slot)[0] * self.block_size
                assert torch.equal(self.cache.storage.pools[0][row], layers[0][0][0])


class InterleavedMachine(CacheMachine):
    layout = "interleaved"
    budget = 18


class PerHeadMachine(CacheMachine):
    layout = "per_head"
    geometry = dict(head_dim=40)  # 160 bytes a token per buffer: several pages a slot
    budget = 8


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestPerLayer = CacheMachine.TestCase
TestPerLayer.settings = SETTINGS
TestInterleaved = InterleavedMachine.TestCase
TestInterleaved.settings = SETTINGS
TestPerHead = PerHeadMachine.TestCase
TestPerHead.settings = SETTINGS
TestPaged = PagedMachine.TestCase
TestPaged.settings = SETTINGS
