"""The cache API a scheduler uses (`KVCacheManager`): random operations against
a model of what each sequence holds, prefix hits checked token by token, and
misuse refused with nothing changed."""
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import make_cache, state, live
from vattn.kv.manager import KVCacheManager

MAX_SEQ = 96
PROMPTS = [[1, 2, 3, 4] * 12, [1, 2, 3, 4] * 6 + [5] * 30, [7, 8] * 20, [9] * 3]  # shared prefixes


def kv_of(c, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[len, H, D]` K and V a token's prefix determines (so a prefix hit can be checked)."""
    rows = [torch.Generator().manual_seed(hash(tuple(tokens[:i + 1])) % 2**31) for i in range(len(tokens))]
    k = torch.stack([torch.randn(c.num_kv_heads, c.head_dim, generator=g) for g in rows]) if rows else \
        torch.zeros(0, c.num_kv_heads, c.head_dim)
    return k, -k


class ManagerMachine(RuleBasedStateMachine):
    layout, budget, geometry = "per_layer", 10, {}  # 96-byte tokens straddle pages: hits copy their tail page

    def __init__(self):
        super().__init__()
        self.cache = make_cache(self.layout, max_num_seqs=4, max_seq_len=MAX_SEQ, pages=self.budget, page_size=4096,
                                **self.geometry)
        self.kv = KVCacheManager(self.cache)
        self.c = self.cache.config
        self.seqs: dict[int, list[int]] = {}  # sequence id -> its tokens
        self.computed: dict[int, int] = {}  # sequence id -> tokens in the cache
        self.swapped: dict[int, object] = {}
        self.next_id = 0

    def compute(self, seq: int, n: int) -> None:
        """Write the next `n` tokens of `seq` (room granted) and tell the manager."""
        tokens, start = self.seqs[seq], self.computed[seq]
        k, v = kv_of(self.c, tokens[:start + n])
        slot = self.kv.slot(seq)
        for layer in range(self.c.num_layers):
            self.cache.data.write(layer, [slot], [start], k[None, start:], v[None, start:])
        self.computed[seq] = start + n
        self.kv.cache_tokens(seq, tokens, start + n)

    @rule(prompt=st.sampled_from(PROMPTS), extra=st.lists(st.integers(20, 30), max_size=8),
          budget=st.integers(1, 64))
    def admit(self, prompt, extra, budget):
        tokens = prompt + extra
        seq, self.next_id = self.next_id, self.next_id + 1
        cached = self.kv.allocate(seq, tokens, budget)
        event("admit", "full" if cached is None else "hit" if cached else "miss")
        if cached is None:
            assert not self.kv.has_slot(seq)
            return
        assert 0 <= cached < len(tokens) and cached in [self.c.tokens_in(j) for j in range(self.c.pages_per_slot)]
        self.seqs[seq], self.computed[seq] = tokens, cached
        if cached:  # what the hit resumed holds exactly this prompt's K/V
            k, _ = kv_of(self.c, tokens[:cached])
            held, _ = live(self.cache, self.kv.slot(seq), 0)
            assert torch.equal(held[:cached], k)
        n = min(budget, len(tokens) - cached)
        assert self.cache.capacity(self.kv.slot(seq)) >= cached + n
        self.compute(seq, n)

    @rule(data=st.data(), n=st.integers(1, 24))
    def grow(self, data, n):
        if not self.seqs:
            return
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        target = min(MAX_SEQ, self.computed[seq] + n)
        if target == self.computed[seq]:
            return
        while len(self.seqs[seq]) < target:
            self.seqs[seq].append(40 + len(self.seqs[seq]) % 7)
        if self.kv.allocate_slots({seq: target}):
            self.compute(seq, target - self.computed[seq])

    @rule(data=st.data())
    def fork(self, data):
        if not self.seqs:
            return
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        n = self.computed[parent]
        if not n:
            return
        child, self.next_id = self.next_id, self.next_id + 1
        if self.kv.fork(parent, child, n):
            self.seqs[child], self.computed[child] = self.seqs[parent][:n], n

    @rule(data=st.data(), swap=st.booleans())
    def free(self, data, swap):
        if not self.seqs:
            return
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        if swap:
            self.swapped[seq] = (self.kv.swap_out(seq), self.seqs.pop(seq), self.computed.pop(seq))
        else:
            self.kv.free(seq)
            del self.seqs[seq], self.computed[seq]

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        handle, tokens, computed = self.swapped[seq]
        if self.kv.swap_in(seq, handle):
            del self.swapped[seq]
            self.seqs[seq], self.computed[seq] = tokens, computed
            self.kv.cache_tokens(seq, tokens, computed)

    @invariant()
    def consistent(self):
        self.kv.check()
        for seq, tokens in self.seqs.items():
            n = self.computed[seq]
            assert self.cache.length(self.kv.slot(seq)) == n
            k, v = kv_of(self.c, tokens[:n])
            got_k, got_v = live(self.cache, self.kv.slot(seq), self.c.num_layers - 1)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert 0 <= self.kv.num_available_pages() <= self.kv.num_pages and 0 <= self.kv.usage <= 1


class PerHeadManagerMachine(ManagerMachine):
    layout, budget, geometry = "per_head", 40, dict(head_dim=64)  # 16 tokens a page: hits share whole pages


TestManager = ManagerMachine.TestCase
TestPerHeadManager = PerHeadManagerMachine.TestCase
for case in (TestManager, TestPerHeadManager):
    case.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def kv():
    cache = make_cache("per_layer", max_num_seqs=3, max_seq_len=MAX_SEQ, page_size=4096)
    kv = KVCacheManager(cache)
    assert kv.allocate("a", PROMPTS[0], 8) == 0 and kv.allocate("b", PROMPTS[2], 8) == 0
    return kv, kv.swap_out("b")


MISUSE = {
    "admit twice": (lambda kv, swapped: kv.allocate("a", [1, 2], 2), "already has a slot"),
    "admit an unhashable id": (lambda kv, swapped: kv.allocate(["c"], [1, 2], 2), "hashable"),
    "admit nothing": (lambda kv, swapped: kv.allocate("c", [], 2), "at least one token"),
    "admit no room asked": (lambda kv, swapped: kv.allocate("c", [1], 0), "num_new_tokens"),
    "admit past max_seq_len": (lambda kv, swapped: kv.allocate("c", [1] * (MAX_SEQ + 1), 2), "max_seq_len"),
    "grow an unknown sequence": (lambda kv, swapped: kv.allocate_slots({"a": 20, "zz": 4}), "has no slot"),
    "grow past max_seq_len": (lambda kv, swapped: kv.allocate_slots({"a": MAX_SEQ + 1}), "max_seq_len"),
    "fork an unknown parent": (lambda kv, swapped: kv.fork("zz", "c", 4), "has no slot"),
    "fork onto a sequence with a slot": (lambda kv, swapped: kv.fork("a", "a", 4), "already has a slot"),
    "fork more than written": (lambda kv, swapped: kv.fork("a", "c", 40), "cannot share"),
    "free an unknown sequence": (lambda kv, swapped: kv.free("zz"), "has no slot"),
    "free an unhashable id": (lambda kv, swapped: kv.free(["a"]), "has no slot"),
    "swap out an unknown sequence": (lambda kv, swapped: kv.swap_out("zz"), "has no slot"),
    "swap in onto a sequence with a slot": (lambda kv, swapped: kv.swap_in("a", swapped), "already has a slot"),
    "cache more tokens than given": (lambda kv, swapped: kv.cache_tokens("a", [1, 2], 3), "num_computed"),
    "slot of an unknown sequence": (lambda kv, swapped: kv.slot("zz"), "has no slot"),
}


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_is_refused_and_changes_nothing(kv, name):
    (kv, swapped), (call, message) = kv, MISUSE[name]
    before = state(kv.cache), [kv.has_slot(seq) for seq in "abc"]
    with pytest.raises(ValueError, match=message):
        call(kv, swapped)
    assert (state(kv.cache), [kv.has_slot(seq) for seq in "abc"]) == before
    kv.check()


def test_queries_never_raise(kv):
    kv, _ = kv
    before = state(kv.cache)
    assert kv.has_slot("a") and not kv.has_slot("zz") and not kv.has_slot(["unhashable"])
    assert kv.num_free_slots == 2 and 0 < kv.num_available_pages() <= kv.num_pages and 0 <= kv.usage <= 1
    assert kv.pages_for(0) == 0
    assert state(kv.cache) == before


def test_a_prompt_resumes_the_pages_another_computed():
    cache = make_cache("per_layer", max_num_seqs=3, max_seq_len=MAX_SEQ, page_size=4096, num_kv_heads=2, head_dim=64)
    kv = KVCacheManager(cache)
    prompt = PROMPTS[0]
    assert kv.allocate("a", prompt, len(prompt)) == 0
    for layer in range(cache.config.num_layers):
        k, v = kv_of(cache.config, prompt)
        cache.data.write(layer, [kv.slot("a")], [0], k[None], v[None])
    kv.cache_tokens("a", prompt, len(prompt))
    hit = kv.allocate("b", prompt + [99], 4)  # a running holder: its pages are shared
    assert hit == len(prompt) == cache.config.tokens_in(6) and cache.stats().pages_shared == 6  # 8 tokens a page
    assert kv.allocate("c", prompt, 4, salt="other") == 0  # another salt never matches
    kv.free("a"), kv.free("b")
    assert kv.allocate("d", prompt + [98], 4) == hit  # an idle holder: resumed in place
    kv.check()
