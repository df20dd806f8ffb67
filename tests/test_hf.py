"""VAttnCache inside transformers' generate(): token-identical to DynamicCache."""
import pytest
import torch
from tiny_models import TINY, tiny_model
from transformers import DynamicCache, StaticCache

from vattn.integrations.hf import KVMemoryError, VAttnCache

MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.9, top_k=20),
    "beam": dict(num_beams=4, do_sample=False),
    "padded batch": dict(do_sample=False),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3),
}
LAYOUTS = {"per_layer": 4096, "per_head": 4096, "interleaved": 4096}


def inputs_for(mode, vocab=96, prompts=None):
    g = torch.Generator().manual_seed(1)
    if prompts is not None:
        return prompts
    if mode == "padded batch":
        ids = torch.randint(2, vocab - 1, (3, 11), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        mask[2, :7] = 0
        ids[mask == 0] = 0
        return dict(input_ids=ids, attention_mask=mask)
    ids = torch.randint(2, vocab - 1, (1, 7), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def generate(model, inputs, mode, cache=None, new_tokens=30):
    torch.manual_seed(1234)
    kwargs = dict(cache=cache) if cache is not None else {}
    return model.generate(**inputs, **MODES[mode], **kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)


def vattn_cache(model, layout, page_size, max_num_seqs=12, max_seq_len=64):
    return VAttnCache.from_model(model, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, layout=layout,
                                 page_size=page_size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", TINY)
def test_tiny_models_match_dynamic_cache(arch, attn, layout, mode):
    model = tiny_model(arch, attn)
    inputs = inputs_for(mode)
    expected = generate(model, inputs, mode)
    cache = vattn_cache(model, layout, LAYOUTS[layout])
    assert torch.equal(generate(model, inputs, mode, cache), expected)
    cache.kv.check()


@pytest.fixture(scope="module")
def smollm2():
    from vattn.models import load_model

    model, tokenizer = load_model()
    chats = [[{"role": "user", "content": text}] for text in
             ("What is the capital of France?", "Name three colours.", "Say hi.")]
    tokenizer.padding_side = "left"
    prompts = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True, padding=True)
    return model, prompts


# every layout with every mode, the attention alternating so that each meets both layouts and modes
# (the tiny models above take the whole grid)
SMOLLM2_CASES = [(("eager", "sdpa")[(i + j) % 2], layout, page_size, mode)
                 for i, (layout, page_size) in enumerate([("per_layer", 64 << 10), ("per_head", 16 << 10),
                                                          ("interleaved", 2 << 20)])
                 for j, mode in enumerate(MODES)]


@pytest.mark.parametrize("attn, layout, page_size, mode", SMOLLM2_CASES)
def test_smollm2_matches_dynamic_cache(smollm2, attn, layout, page_size, mode):
    model, prompts = smollm2
    model.set_attn_implementation(attn)
    inputs = dict(prompts) if mode == "padded batch" else {k: v[:1, -30:] for k, v in prompts.items()}
    expected = generate(model, inputs, mode, new_tokens=12)
    cache = vattn_cache(model, layout, page_size, max_seq_len=128)
    assert torch.equal(generate(model, inputs, mode, cache, new_tokens=12), expected)


def test_memory_grows_with_tokens_where_static_commits_everything():
    model = tiny_model("llama", "sdpa")
    inputs = inputs_for("padded batch")
    cache = vattn_cache(model, "per_layer", 4096, max_seq_len=256)
    c = cache.kv.config
    mapped = []
    for n in (8, 40, 100, 200):
        cache.reset()
        generate(model, inputs, "greedy", cache, new_tokens=n)
        st = cache.stats()
        rows = inputs["input_ids"].shape[0]
        assert st.mapped_bytes - st.live_bytes <= rows * c.page_bytes
        mapped.append(st.mapped_bytes)
    assert mapped == sorted(mapped) and mapped[0] < mapped[-1]
    static = StaticCache(config=model.config, max_cache_len=256)
    generate(model, inputs, "greedy", static, new_tokens=8)
    static_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in static.layers)
    assert static_bytes == 2 * c.num_layers * 3 * 256 * c.num_kv_heads * c.head_dim * 4
    assert mapped[0] < static_bytes / 4


def test_beam_search_shares_pages():
    model = tiny_model("llama", "eager")
    inputs = inputs_for("beam")
    cache = vattn_cache(model, "per_layer", 4096)
    out = generate(model, inputs, "beam", cache, new_tokens=50)
    assert torch.equal(out, generate(model, inputs, "beam", new_tokens=50))
    c = cache.kv.config
    length = cache.get_seq_length()
    st = cache.stats()
    assert st.pages_shared > 0
    assert st.pages_mapped < 4 * c.pages_for(length)  # fewer than beams × length
    cache.kv.check()


def fill(cache, rows, n, layers=2, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    for layer in range(layers):
        k, v = torch.randn(rows, heads, n, dim, generator=g), torch.randn(rows, heads, n, dim, generator=g)
        cache.update(k, v, layer)


def same(a, b):
    for la, lb in zip(a.layers, b.layers):
        ka, va = la.keys, la.values
        assert torch.equal(ka, lb.keys) and torch.equal(va, lb.values)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_operations_match_dynamic_cache(layout):
    model = tiny_model("llama", "eager")
    ref, cache = DynamicCache(config=model.config), vattn_cache(model, layout, 4096, max_seq_len=100)
    for c in (ref, cache):
        fill(c, 3, 70)
        c.reorder_cache(torch.tensor([2, 0, 0]))
        c.crop(-5)
        fill(c, 3, 2, seed=1)
        c.batch_repeat_interleave(3)
        fill(c, 9, 1, seed=2)
        c.batch_select_indices(torch.tensor([8, 1, 4, 4]))
        fill(c, 4, 3, seed=3)
    same(ref, cache)
    assert cache.get_seq_length() == ref.get_seq_length() == 71
    cache.kv.check()


def test_repeat_interleave_shares_the_prompt():
    model = tiny_model("llama", "eager")
    cache = vattn_cache(model, "per_layer", 4096)
    fill(cache, 1, 60)
    used = cache.stats().pages_mapped
    cache.batch_repeat_interleave(4)
    assert cache.stats().pages_mapped == used + 3  # 3 copies of the partly filled page only


def test_bad_input_raises_and_leaks_nothing():
    model = tiny_model("llama", "sdpa")
    cache = vattn_cache(model, "per_layer", 4096, max_num_seqs=2, max_seq_len=32)
    total = cache.stats().pages_total
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        generate(model, inputs_for("padded batch"), "greedy", cache)
    assert cache.stats().pages_free == total and cache.rows == 0
    with pytest.raises(ValueError, match="max_seq_len=32"):
        generate(model, inputs_for("greedy"), "greedy", cache, new_tokens=40)
    cache.reset()
    st = cache.stats()
    assert st.pages_free + st.pages_idle == total and st.active_slots == 0
    other = tiny_model("qwen2", "sdpa")
    other.config.num_key_value_heads = 4
    wrong = VAttnCache.from_model(other, max_num_seqs=2, max_seq_len=32)
    with pytest.raises(ValueError, match="4 × 16"):
        generate(model, inputs_for("greedy"), "greedy", wrong)
    deeper = vattn_cache(model, "per_layer", 4096)
    with pytest.raises(ValueError, match="layer 2"):
        deeper.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 2)
    assert deeper.stats().pages_free == deeper.stats().pages_total


def test_memory_budget_exhausted_is_clear():
    model = tiny_model("llama", "sdpa")
    cache = VAttnCache.from_model(model, max_num_seqs=4, max_seq_len=200, page_size=4096, memory_budget=4 * 4096 * 4)
    with pytest.raises(KVMemoryError, match="budget"):
        generate(model, inputs_for("padded batch"), "greedy", cache, new_tokens=150)
    cache.reset()
    assert cache.stats().pages_free + cache.stats().pages_idle == cache.stats().pages_total
