"""vattn's CPU attention kernel (`vattn.attention.native`) against torch SDPA on
the same K/V, over the virtual cache's views in every layout, and every input
it must refuse."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_elementwise import forced, runnable_isas

from vattn import _native, attention
from vattn.attention.batch import StepBatch
from vattn.attention.registry import pick_for
from vattn.binding import attend, request_table
from vattn.config import CacheConfig
from vattn.kv.virtual import VirtualKVCache


def reference(q, K, V, table, scale, window=None) -> torch.Tensor:
    """SDPA in float32, request by request: query i of a request attends to
    rows [max(start, p + 1 - window), p] of its slot, p its position."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    G = q.shape[1] // K.shape[2]
    rows = list(table)
    for slot, start, length, first, n in (rows[i:i + 5] for i in range(0, len(rows), 5)):
        if not n:
            continue
        keys = torch.arange(length)
        pos = torch.arange(length - n, length)[:, None]
        mask = (keys >= start) & (keys <= pos)
        if window:
            mask &= keys > pos - window
        k, v = (t[slot, :length].float().repeat_interleave(G, 1).transpose(0, 1) for t in (K, V))
        out[first:first + n] = F.scaled_dot_product_attention(q[first:first + n].float().transpose(0, 1), k, v,
                                                              attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def close(out, ref, dtype) -> bool:
    if not ref.numel():
        return True
    err = (out.float() - ref).abs().max()
    return bool(err <= (1e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max().clamp(min=1))


def cache_views(layout, heads, kv_heads, dim, lengths, dtype, seed=0, slots=None, max_seq_len=None):
    """A virtual cache holding random K/V of `lengths` at `slots` (layer 1 of two); its views."""
    slots = slots or list(range(len(lengths)))
    cache = VirtualKVCache(CacheConfig(2, kv_heads, dim, dtype, max_num_seqs=max(slots) + 1,
                                       max_seq_len=max_seq_len or max(max(lengths), 1), layout=layout))
    g = torch.Generator().manual_seed(seed)
    for slot in range(max(slots) + 1):
        assert cache.allocate(1, slot=slot) == slot
    for slot, n in zip(slots, lengths):
        if n:
            cache.grow(slot, n)
            k, v = (torch.randn(1, n, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
            cache.data.write(1, [slot], [0], k, v)
    return cache, *cache.data.views(1)


@pytest.mark.parametrize("layout", ["per_head", "per_layer", "interleaved"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 8, 64), (9, 3, 64), (16, 4, 80), (16, 2, 96), (32, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_sdpa(layout, heads, kv_heads, dim, dtype):
    """Mixed lengths 1-4096 in one call, a zero-length request, slots out of order and not contiguous."""
    lengths = [1, 4096, 0, 700, 33, 2048, 9]
    slots = [6, 0, 3, 4, 1, 8, 2]
    cache, K, V = cache_views(layout, heads, kv_heads, dim, lengths, dtype, slots=slots)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    table = request_table((slot, 0, n, i, 1 if n else 0) for i, (slot, n) in enumerate(zip(slots, lengths)))
    out = attend(q, K, V, table, dim ** -0.5)
    live = [i for i, n in enumerate(lengths) if n]
    assert close(out[live], reference(q, K, V, table, dim ** -0.5)[live], dtype)


@pytest.mark.parametrize("window", [None, 1, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_and_windows_equal_sdpa(window, dtype):
    """Decode tokens and prefill chunks with history in one call (the engine's
    forward), each bottom-right causal, starts past zero, sliding windows."""
    heads, kv_heads, dim = 12, 4, 64
    lengths = [500, 257, 64, 1000]
    cache, K, V = cache_views("per_head", heads, kv_heads, dim, lengths, dtype)
    rows = [(0, 0, 500, 0, 1), (1, 0, 257, 1, 100), (2, 10, 64, 101, 54), (3, 200, 1000, 155, 3)]
    table = request_table(rows)
    q = torch.randn(158, heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = attend(q, K, V, table, 0.1, window)
    assert close(out, reference(q, K, V, table, 0.1, window), dtype)


@pytest.mark.parametrize("layout", ["per_head", "per_layer", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_k_and_v_are_stored_at_each_request_s_rows_before_it_attends(layout, dtype):
    """Decode tokens and a prefill chunk append their K/V in the same call
    that attends over them (the engine's step); other rows stay as they were."""
    heads, kv_heads, dim = 6, 2, 64
    lengths, new = [300, 40, 0], [1, 1, 70]
    cache, K, V = cache_views(layout, heads, kv_heads, dim, lengths, dtype, max_seq_len=512)
    for slot, (n, m) in enumerate(zip(lengths, new)):
        cache.grow(slot, n + m)  # the engine maps the rows before it writes them
    g = torch.Generator().manual_seed(6)
    T = sum(new)
    q, new_k, new_v = (torch.randn(T, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    table = request_table([(0, 0, 301, 0, 1), (1, 0, 41, 1, 1), (2, 0, 70, 2, 70)])
    before_k, before_v = K.clone(), V.clone()
    out = attend(q, K, V, table, 0.125, None, None, new_k, new_v)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for (slot, row), token in zip([(0, 300), (1, 40), *((2, r) for r in range(70))], range(T)):
        expected_k[slot, row], expected_v[slot, row] = new_k[token], new_v[token]
    assert torch.equal(K, expected_k) and torch.equal(V, expected_v)
    assert close(out, reference(q, K, V, table, 0.125), dtype)


def test_new_k_and_v_of_the_wrong_shape_are_refused_with_nothing_written():
    cache, K, V = cache_views("per_layer", 4, 2, 64, [10, 64], torch.float32)
    table = request_table([(0, 0, 10, 0, 1), (1, 0, 64, 1, 3)])
    q, out = torch.randn(4, 4, 64), torch.full((4, 4, 64), 7.0)
    before = K.clone(), V.clone(), out.clone()
    for new_k, new_v, message in [(torch.randn(4, 3, 64), torch.randn(4, 3, 64), r"\[T, H_kv, D\] = \[4, 2, 64\]"),
                                  (torch.randn(3, 2, 64), torch.randn(3, 2, 64), "new_k and new_v are"),
                                  (torch.randn(4, 2, 64), None, "new_v must be a tensor"),
                                  (torch.randn(4, 2, 64).bfloat16(), torch.randn(4, 2, 64).bfloat16(), "q's dtype")]:
        with pytest.raises(ValueError, match=message):
            attend(q, K, V, table, 0.1, None, out, new_k, new_v)
        assert all(torch.equal(a, b) for a, b in zip((K, V, out), before))


def test_the_engine_s_attend_stores_the_step_s_k_v_and_writes_into_the_out_it_is_given():
    """`vattn.attention.attend` over a prepared step: the native kernel appends,
    the cache records the write; an `out` that does not fit q is refused
    before anything is stored."""
    heads, kv_heads, dim = 6, 2, 64
    cache, K, V = cache_views("per_layer", heads, kv_heads, dim, [20, 7], torch.float32, max_seq_len=64)
    g = torch.Generator().manual_seed(7)
    for slot, n, grown in ((0, 20, 21), (1, 7, 11)):
        cache.grow(slot, grown)
        cache.data.write(0, [slot], [0], *(torch.randn(1, n, kv_heads, dim, generator=g) for _ in "kv"))  # layer 0 too
    q, k, v = (torch.randn(5, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    step = attention.prepare(StepBatch([0], [20], [(1, 7, 4)]), cache.data, pick_for(cache))  # a decode, a chunk
    assert step.kernel.name == "native" and step.kernel.stores_kv
    before = K.clone(), V.clone()
    with pytest.raises(ValueError, match=r"out is torch.float32 \(5, 6, 32\)"):
        attention.attend(step, 1, q, k, v, 0.125, 0, torch.empty(5, heads, 32))
    assert torch.equal(K, before[0]) and torch.equal(V, before[1])
    out = torch.full_like(q, 7.0)
    assert attention.attend(step, 1, q, k, v, 0.125, 0, out) is out
    assert torch.equal(K[0, 20], k[0]) and torch.equal(K[1, 7:11], k[1:]) and torch.equal(V[1, 7:11], v[1:])
    assert cache.length(0, 1) == 21 and cache.length(1, 1) == 11
    table = request_table([(0, 0, 21, 0, 1), (1, 0, 11, 1, 4)])
    assert close(out, reference(q, K, V, table, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", runnable_isas())
def test_every_instruction_set_gives_the_reference_s_answer(isa, dtype):
    cache, K, V = cache_views("per_layer", 16, 4, 128, [300, 1500, 77], dtype)
    q = torch.randn(40, 16, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    table = request_table([(0, 0, 300, 0, 1), (1, 0, 1500, 1, 1), (2, 0, 77, 2, 38)])
    with forced(isa):
        out = attend(q, K, V, table, 0.09, 50)
    assert close(out, reference(q, K, V, table, 0.09, 50), dtype)


@pytest.mark.parametrize("dim", [64, 80, 128, 256])
@pytest.mark.parametrize("isa", runnable_isas())
def test_prefill_chunks_in_bfloat16_give_the_reference_s_answer_on_every_instruction_set(isa, dim):
    """Prefill tiles of 17 to 32 queries in bfloat16 (AMX tiles where the CPU has them and the head
    dimension is a multiple of 32, 80 is not; else pairs on vdpbf16ps where it has AVX512-BF16):
    blocks cut short by a length or a start (an odd number of rows), causal diagonals, a window, and
    a chunk that ends mid-block."""
    heads, kv_heads = 8, 2
    lengths = [70, 333, 1000, 45]
    cache, K, V = cache_views("per_head", heads, kv_heads, dim, lengths, torch.bfloat16)
    rows = [(0, 0, 70, 0, 70), (1, 5, 333, 70, 300), (2, 0, 1000, 370, 5), (3, 0, 45, 375, 17)]
    q = torch.randn(392, heads, dim, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    table = request_table(rows)
    for window in (None, 40):
        with forced(isa):
            out = attend(q, K, V, table, dim ** -0.5, window)
        assert close(out, reference(q, K, V, table, dim ** -0.5, window), torch.bfloat16)


def smollm2_attention_inputs(min_tokens: int = 400) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's queries, keys and values ([H, n, D], [Hkv, n, D], after rotary) as SmolLM2 in
    bfloat16 computes them over the first ShareGPT chat of at least `min_tokens` tokens."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from vattn.models import load_model
    from vattn.sharegpt import chat_prompt, sample

    model, tokenizer = load_model(dtype=torch.bfloat16)
    ids = next(p for p in (chat_prompt(tokenizer, r.prompt) for r in sample(tokenizer, 48)) if len(p) >= min_tokens)
    caught = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        caught.append((query[0].clone(), key[0].clone(), value[0].clone()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["vattn_capture"] = capture
    model.config._attn_implementation = "vattn_capture"
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        del ALL_ATTENTION_FUNCTIONS["vattn_capture"]
    return caught


@pytest.mark.slow
def test_smollm2_s_attention_in_bfloat16_is_as_accurate_as_sdpa_on_every_instruction_set():
    """On SmolLM2's own queries, keys and values in bfloat16 (a ShareGPT chat of 400+ tokens, every
    layer: scores up to about 70), a prefill of the whole chat in one call is as close to attention
    in float64 as transformers' SDPA in bfloat16 (its reference), layer by layer, whichever
    instruction set runs it: pairs on vdpbf16ps round the probabilities to bfloat16 before P·V as
    SDPA's kernel does, widened ones do not."""
    isas = runnable_isas()
    worst = {isa: 0.0 for isa in isas}
    for q, k, v in smollm2_attention_inputs():
        (H, n, D), Hkv = q.shape, k.shape[0]
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        causal = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), 1)
        exact = ((q.double() @ k.double().transpose(1, 2) * D ** -0.5 + causal).softmax(-1) @ v.double())
        sdpa_error = rms(F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0], exact)
        cache, K, V = cache_views("per_head", H, Hkv, D, [n], torch.bfloat16)
        K[0, :n], V[0, :n] = k[::H // Hkv].transpose(0, 1), v[::H // Hkv].transpose(0, 1)
        table = request_table([(0, 0, n, 0, n)])
        for isa in isas:
            with forced(isa):
                out = attend(q.transpose(0, 1).contiguous(), K, V, table, D ** -0.5).transpose(0, 1)
            worst[isa] = max(worst[isa], rms(out, exact) / sdpa_error)
    print("rms error over SDPA's, worst layer:", {isa: round(r, 3) for isa, r in worst.items()})
    assert all(r <= 1.05 for r in worst.values()), worst


def rms(x: torch.Tensor, exact: torch.Tensor) -> float:
    return (x.double() - exact).pow(2).mean().sqrt().item()


def test_threads_split_long_requests_and_merge_them():
    """A long decode and a prefill chunk with history (its tiles of many
    queries taken in lanes) on several threads, cut into splits and merged;
    any thread count gives the single-thread answer."""
    cache, K, V = cache_views("per_head", 6, 3, 64, [4000, 1300], torch.float32)
    q = torch.randn(201, 6, 64, generator=torch.Generator().manual_seed(4))
    table = request_table([(0, 0, 4000, 0, 1), (1, 0, 1300, 1, 200)])
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 8):
            torch.set_num_threads(n)
            outs.append(attend(q, K, V, table, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.allclose(o, outs[0], rtol=1e-5, atol=1e-6) for o in outs)
    assert close(outs[0], reference(q, K, V, table, 0.125), torch.float32)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), group=st.sampled_from([1, 3, 4, 8]), dim=st.sampled_from([16, 64, 80, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), window=st.sampled_from([None, 1, 7, 100]))
def test_any_shape_and_lengths_equal_sdpa(data, group, dim, dtype, window):
    kv_heads = data.draw(st.integers(1, 3))
    lengths = data.draw(st.lists(st.integers(0, 600), min_size=1, max_size=5))
    cache, K, V = cache_views(data.draw(st.sampled_from(["per_head", "per_layer", "interleaved"])),
                              kv_heads * group, kv_heads, dim, lengths, dtype)
    rows, first = [], 0
    for slot, n in enumerate(lengths):
        num_q = data.draw(st.integers(0, min(n, 20)))
        start = data.draw(st.integers(0, n - num_q)) if num_q else 0
        rows.append((slot, start, n, first, num_q))
        first += num_q
    q = torch.randn(max(first, 1), kv_heads * group, dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    table = request_table(rows)
    out = attend(q, K, V, table, dim ** -0.5, window)
    assert close(out[:first], reference(q, K, V, table, dim ** -0.5, window)[:first], dtype)


def bad_inputs():
    """(what is wrong, the keyword to change, its value, the message) of one good call."""
    K = torch.zeros(3, 64, 2, 64)
    return [
        ("a float16 query", "q", torch.zeros(4, 4, 64, dtype=torch.float16), "float32 or bfloat16"),
        ("K in bfloat16, q in float32", "k", K.to(torch.bfloat16), "one dtype"),
        ("a last dimension that is not contiguous", "k", torch.zeros(3, 64, 2, 128)[..., ::2], "not contiguous"),
        ("a query whose last dimension is strided", "q", torch.zeros(4, 4, 128)[:, :, ::2], "not contiguous"),
        ("a length past the view", "table", request_table([(0, 0, 65, 0, 1)]), "past the view's 64 rows"),
        ("a negative length", "table", request_table([(0, 0, -1, 0, 0)]), "negative"),
        ("a negative start", "table", request_table([(0, -3, 10, 0, 1)]), "negative"),
        ("a start past the first query", "table", request_table([(0, 10, 12, 0, 4)]), "start 10 is past"),
        ("more queries than tokens", "table", request_table([(0, 0, 2, 0, 3)]), "3 queries in 2 tokens"),
        ("query rows past q", "table", request_table([(0, 0, 10, 3, 2)]), "outside q's 4 tokens"),
        ("a slot outside the view", "table", request_table([(3, 0, 10, 0, 1)]), "slot 3 is outside"),
        ("heads that do not divide", "q", torch.zeros(4, 3, 64), "3 query heads do not divide into 2"),
        ("mismatched head dims", "q", torch.zeros(4, 4, 32), "q has head_dim 32"),
        ("a head dim the kernel does not take", "kv", torch.zeros(3, 64, 2, 72), "head_dim 72: the kernel takes"),
        ("an output of another shape", "out", torch.zeros(3, 4, 64), "out is"),
        ("a ragged request table", "table", request_table([(0, 0, 10, 0, 1)])[:4], "5 int64 fields"),
        ("a negative window", "window", -2, "negative"),
        ("a query on another device", "q", torch.zeros(4, 4, 64, device="meta"), "on meta"),
    ]


@pytest.mark.parametrize("what, name, value, message", bad_inputs(), ids=[b[0] for b in bad_inputs()])
def test_bad_input_raises_and_writes_nothing(what, name, value, message):
    K, V = torch.randn(3, 64, 2, 64), torch.randn(3, 64, 2, 64)
    args = dict(q=torch.randn(4, 4, 64), k=K, v=V, table=request_table([(0, 0, 10, 0, 1), (2, 0, 64, 1, 3)]), scale=0.1,
                window=None, out=torch.full((4, 4, 64), 7.0))
    if name == "kv":
        args["k"] = args["v"] = value
        args["q"] = torch.zeros(4, 4, value.shape[-1])
    else:
        args[name] = value
    if name in ("q", "kv") and value.device.type == "cpu":
        args["out"] = torch.full(args["q"].shape, 7.0, dtype=args["q"].dtype)  # the output follows q
    out = args["out"]
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(ValueError, match=message):
        attend(**args)
    if before is not None:
        assert torch.equal(out, before)


STRICT = """
import torch
from vattn.backends import HostBackend
HostBackend.zero_backing = False  # no zero page: one read past mapped memory faults
from vattn.binding import attend, request_table
from vattn.config import CacheConfig
from vattn.kv.virtual import VirtualKVCache
for layout in ("per_head", "per_layer", "interleaved"):
    cache = VirtualKVCache(CacheConfig(2, 2, 64, torch.float32, max_num_seqs=4, max_seq_len=4096, layout=layout,
                                       page_size=4096))
    assert not cache.storage.reservation.zero_backed
    lengths = [1, 3000, 64, 65]
    for slot, n in enumerate(lengths):
        assert cache.allocate(n) == slot
        cache.data.write(0, [slot], [0], torch.randn(1, n, 2, 64), torch.randn(1, n, 2, 64))
    K, V = cache.data.views(0)
    q = torch.randn(40, 8, 64)
    out = attend(q, K, V, request_table([(0, 0, 1, 0, 1), (1, 0, 3000, 1, 30), (2, 0, 64, 31, 1), (3, 60, 65, 32, 5)]),
                 0.125, 16)
    assert torch.isfinite(out[:37]).all()
print("OK")
"""


def test_the_kernel_reads_no_row_past_a_length():
    """Without the zero page, every slot mapped only as far as its length (the
    first a page of one token): a read past a length would kill the process."""
    out = subprocess.run([sys.executable, "-c", STRICT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    assert out.stdout.strip().endswith("OK")


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_generate_over_vattn_cache_with_the_native_kernel_equals_sdpa(arch):
    """VAttnCache's path: transformers' generate() with the native kernel over
    the cache's views gives SDPA's tokens, for a left-padded batch (the
    kernel reads each row from its first real token) and for beam search."""
    from tiny_models import CACHE_KEYWORD, tiny_model
    from vattn.integrations.hf import VAttnCache

    model = tiny_model(arch, "sdpa")
    ids = torch.tensor([[0, 0, 0, 5, 17, 33, 8], [4, 9, 21, 60, 2, 11, 3]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    runs = [dict(max_new_tokens=30, do_sample=False), dict(max_new_tokens=12, num_beams=3, do_sample=False)]
    expected = [model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **r) for r in runs]
    cache_rows = [2, 6]
    model.set_attn_implementation("vattn_native")
    for run, want, rows in zip(runs, expected, cache_rows):
        cache = VAttnCache.from_model(model, max_num_seqs=rows, max_seq_len=64)
        assert cache.attn_implementation == "vattn_native"
        got = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0, **{CACHE_KEYWORD: cache}, **run)
        assert torch.equal(got, want)
