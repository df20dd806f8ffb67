"""The engine's own forward (`vattn.executor.forward`): the model's logits bit
for bit on every step (within float32 rounding with its elementwise work
fused), and the model's own forward wherever it would not be transformers'
arithmetic."""
import ctypes
from array import array

import numpy as np
import pytest
import torch
from test_engine import engine_for, greedy, hf_greedy, prompts, run
from test_linears import unknown_architecture
from tiny_models import SMALL, TINY, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from vattn import SamplingParams, _native
import vattn.executor.gemm as gemm
from vattn.executor.forward import DecoderForward


def dynamic_rope_llama():
    """Llama whose rotary frequencies change once a step reaches past 32 positions."""
    torch.manual_seed(0)
    config = LlamaConfig(**SMALL | dict(max_position_embeddings=32),
                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    return LlamaForCausalLM(config).eval()


def compare_each_step(engine, same) -> list[bool]:
    """Have every step run both forwards, the own one's logits going on; one
    entry a step: whether `same(own logits, the model's)`."""
    runner, equal = engine.runner, []
    own = runner.decoder

    def both(ids, positions, rows, step):
        logits = own(ids, positions, rows, step)
        equal.append(same(logits, runner._model_logits(ids[None], positions[None], rows, step)))  # rewrites the K/V
        return logits

    runner.decoder = both
    return equal


def within_rounding(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", [{}, dict(pack_linears=False, fuse_projections=False),
                                      dict(attention="sdpa", preemption_mode="swap")], ids=["packed", "plain", "sdpa"])
@pytest.mark.parametrize("fuse, same", [(False, torch.equal), (True, within_rounding)], ids=["exact", "fused"])
@pytest.mark.parametrize("arch", [*TINY, "dynamic_rope"])
def test_the_own_forward_gives_the_models_logits(arch, fuse, same, settings):
    """Bit for bit; with the elementwise work fused, within float32 rounding."""
    model = dynamic_rope_llama() if arch == "dynamic_rope" else tiny_model(arch, "sdpa")
    long = dict(allow_long_max_seq_len=True) if arch == "dynamic_rope" else {}  # dynamic RoPE stretches past 32
    engine = engine_for(model, fuse_elementwise=fuse, **settings, **long)
    assert engine.runner.decoder is not None and engine.runner.decoder.elementwise == fuse
    assert (engine.runner.decoder._rotary is None) == (arch == "dynamic_rope")  # dynamic: made each step
    equal = compare_each_step(engine, same)
    samples = SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2)
    run(engine, [(p, greedy()) for p in prompts()] + [(prompts([20])[0], samples)])
    assert len(equal) > 10 and all(equal)
    engine.close()


def test_the_fused_forward_writes_into_the_same_buffers_every_step():
    engine = engine_for(tiny_model("llama", "sdpa"))
    decoder, seen = engine.runner.decoder, []

    def step(ids, positions, rows, batch):
        logits = DecoderForward.__call__(decoder, ids, positions, rows, batch)
        seen.append({site: t.data_ptr() for site, t in decoder._buffers._flat.items()})
        return logits

    engine.runner.decoder = step
    out = run(engine, [(p, greedy(12)) for p in prompts([40, 50])])
    assert out == [[hf_greedy(tiny_model("llama", "sdpa"), p, 12)] for p in prompts([40, 50])]
    sites = {"qkv", "attention", "o", "gate_up", "act", "down", "logits"}
    if gemm.serves(torch.ones(1, 1)):  # every layer in one native call, its sampled rows gathered in place
        assert decoder._one_call[1] is not None and set(seen[0]) == sites | {"x"}
    else:
        assert set(seen[0]) == sites | {"sampling", "residual"}
    # grown at most while both requests start (their prefill, then both sampling); reused since
    assert len(seen) > 10 and all(buffers == seen[2] for buffers in seen[2:])


def layer_loop_logits(decoder, ids, positions, rows, step) -> torch.Tensor:
    """The fused forward's logits by its layer loop in Python, the native call set aside."""
    kept, decoder._one_call = decoder._one_call, (step.data, None, [])
    try:
        return DecoderForward.__call__(decoder, ids, positions, rows, step).clone()
    finally:
        decoder._one_call = kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, config", [*((arch, {}) for arch in TINY), ("llama", dict(mlp_bias=True)),
                                          ("llama", dict(intermediate_size=80))],
                         ids=[*TINY, "llama-mlp-bias", "llama-mlp-of-80"])
def test_every_layer_in_one_native_call_gives_the_layer_loops_logits_bit_for_bit(arch, config, dtype):
    """Where vattn's GEMM runs the dtype (float32: AVX-512; bfloat16: where
    oneDNN does not pack it), the fused forward's layers run in one native
    call: the same kernels in the same order as its loop in Python, but for
    the MLP's gate and up, one gated GEMM there (silu(gate) * up made as its
    up half is computed) where its width is a multiple of the GEMM's panel
    (SMALL's 96; not 80), and the loop's GEMM and silu_mul."""
    assert SMALL["intermediate_size"] % gemm.PANEL == 0 and 80 % gemm.PANEL
    model = tiny_model(arch, "sdpa", **config).to(dtype)
    reference = [hf_greedy(model, p, 30) for p in prompts()]
    engine = engine_for(model)
    decoder, equal = engine.runner.decoder, []

    def step(ids, positions, rows, batch):
        loop = layer_loop_logits(decoder, ids, positions, rows, batch)
        logits = DecoderForward.__call__(decoder, ids, positions, rows, batch)  # stores the same K/V again
        equal.append(torch.equal(logits, loop))
        return logits

    engine.runner.decoder = step
    reqs = [(p, greedy(30)) for p in prompts()] + [(prompts([20])[0], SamplingParams(max_tokens=12, n=2, seed=3))]
    out = run(engine, reqs)
    assert len(equal) > 10 and all(equal)
    assert (decoder._one_call[1] is not None) == gemm.serves(torch.ones(1, 1, dtype=dtype))
    engine.close()
    tokens = [o[0] for o in out[:len(reference)]]
    assert all(near_tie(model, p, t, r) if dtype == torch.bfloat16 else t == r
               for p, t, r in zip(prompts(), tokens, reference))


def _bytes(rows: tuple) -> bytes:
    """The bytes of an (address, dtype code, rows, columns, row stride) matrix."""
    address, dtype, n, cols, stride = rows
    return ctypes.string_at(address, ((n - 1) * stride + cols) * (2 if dtype else 4))


def test_a_bad_native_layer_call_raises_and_writes_nothing(monkeypatch):
    """Each bad argument is refused before any layer runs: the residual, the
    step's buffers and the K/V rows the step would store are as they were
    (in a dtype the native layer call runs here: where vattn's GEMM does)."""
    model = tiny_model("llama", "sdpa").to(torch.float32 if gemm.serves(torch.ones(1, 1)) else torch.bfloat16)
    engine = engine_for(model)
    reference = run(engine, [(p, greedy(8)) for p in prompts()])
    engine.close()
    engine = engine_for(model)
    decoder, real, refused = engine.runner.decoder, _native.decoder_layers, []
    batches = []

    def step(ids, positions, rows, batch):
        batches.append(batch)
        return DecoderForward.__call__(decoder, ids, positions, rows, batch)

    def checked(layers, residual, x, qkv, *rest):
        table, sampled, heads, threads = rest[-4:]
        batch = batches[-1]
        rows_kv = [(k[slot, length - n:length].clone(), v[slot, length - n:length].clone())
                   for layer in range(len(layers)) for k, v in [batch.data.views(layer)]
                   for slot, _, length, _, n in zip(*[iter(table)] * 5)]
        before = [_bytes(residual), _bytes(qkv)]
        wrong_panels = (*layers[1][0][:2], layers[1][0][2] - 1, *layers[1][0][3:])
        short = (*residual[:2], residual[2] - 1, *residual[3:])
        past = array("q", table)
        past[2] = 10 ** 6
        bad = {
            "layer 1: panels are": ((layers[0], (wrong_panels, *layers[1][1:]), *layers[2:]), residual, x, qkv, *rest),
            "sampled rows must rise": (layers, residual, x, qkv, *rest[:-3], np.asarray([1, 0]), heads, threads),
            "length 1000000 is past": (layers, residual, x, qkv, *rest[:-4], past, sampled, heads, threads),
            "the step's buffers have": (layers, short, x, qkv, *rest),
            "5 query heads and 2 K/V heads": (layers, residual, x, qkv, *rest[:-2], heads + 1, threads),
        }
        for message, args in bad.items() if not refused else ():
            with pytest.raises(ValueError, match=message):
                real(*args)
            assert [_bytes(residual), _bytes(qkv)] == before
            assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(rows_kv, [
                (k[slot, length - n:length], v[slot, length - n:length])
                for layer in range(len(layers)) for k, v in [batch.data.views(layer)]
                for slot, _, length, _, n in zip(*[iter(table)] * 5)]))
            refused.append(message)
        with pytest.raises(TypeError, match="a layer is"):
            real((layers[0][:-1],), residual, x, qkv, *rest)
        return real(layers, residual, x, qkv, *rest)

    monkeypatch.setattr(_native, "decoder_layers", checked)
    engine.runner.decoder = step
    assert run(engine, [(p, greedy(8)) for p in prompts()]) == reference
    assert len(refused) == 5
    engine.close()


@pytest.mark.parametrize("arch", list(TINY))
def test_the_engine_equals_hf_generate_with_and_without_its_own_forward(arch):
    model = tiny_model(arch, "sdpa")
    reference = [[hf_greedy(model, p, 40)] for p in prompts()]
    for own, fuse in ((True, True), (True, False), (False, True)):
        engine = engine_for(model, own_forward=own, fuse_elementwise=fuse)
        assert (engine.runner.decoder is not None) == own
        assert run(engine, [(p, greedy()) for p in prompts()]) == reference
        engine.close()


def near_tie(model, prompt: list[int], tokens: list[int], reference: list[int], steps: int = 2,
             within: float | None = None) -> bool:
    """Whether `tokens` part from `reference` first where the reference's
    top two logits lie within bfloat16's resolution of each other: there
    rounding picks either.  The resolution is `steps` bfloat16 steps at the
    top logit: the logits are bfloat16 sums over a hidden state whose last
    bit follows the order each GEMM sums in, so two forwards of a few
    layers differ by a step each way; or `within`, a margin in logits (over
    a deep model's layers:
    `test_smollm2_in_bfloat16_equals_hf_generate_but_at_near_ties`)."""
    at = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if at is None:
        return len(tokens) == len(reference)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + reference[:at]])).logits[0, -1].float()
    top = logits.topk(2).values
    step = 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)  # bfloat16 keeps 8 significant bits
    return bool(top[0] - top[1] <= (steps * step if within is None else within))


@pytest.mark.parametrize("arch", list(TINY))
def test_bfloat16_runs_the_fused_forward_and_equals_hf_generate_but_at_near_ties(arch):
    """bfloat16 rows run the elementwise kernels; the greedy tokens equal
    transformers' in bfloat16 but where its top two logits are closer than
    bfloat16 resolves (printed: how many prompts part there)."""
    model = tiny_model(arch, "sdpa").to(torch.bfloat16)
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    engine = engine_for(model)
    assert engine.runner.decoder is not None and engine.runner.decoder.elementwise
    tokens = [out[0] for out in run(engine, [(p, greedy()) for p in prompts()])]
    engine.close()
    parted = [i for i, (t, r) in enumerate(zip(tokens, reference)) if t != r]
    print(f"{arch} bfloat16: {len(prompts()) - len(parted)} of {len(prompts())} prompts equal, {len(parted)} part "
          f"at a near-tie")
    assert all(near_tie(model, prompts()[i], tokens[i], reference[i]) for i in parted)
    assert len(parted) < len(prompts())


def hooked_llama():
    """A Llama whose first MLP's output a forward hook halves: not transformers' arithmetic alone."""
    model = tiny_model("llama", "sdpa")
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0.5)
    return model


class OtherLayer(type(tiny_model("llama", "sdpa").model.layers[0])):
    """A decoder layer of the user's own (a subclass): its forward may differ."""


def swapped_layer_llama():
    model = tiny_model("llama", "sdpa")
    model.model.layers[1].__class__ = OtherLayer
    return model


@pytest.mark.parametrize("make", [unknown_architecture, hooked_llama, swapped_layer_llama],
                         ids=["qwen3", "hooked", "subclassed_layer"])
def test_a_model_it_does_not_know_runs_its_own_forward(make):
    model = make()
    assert DecoderForward.of(model, 160) is None
    reference = [[hf_greedy(model, p, 30)] for p in prompts()]
    engine = engine_for(model)
    assert engine.runner.decoder is None
    assert run(engine, [(p, greedy(30)) for p in prompts()]) == reference
    engine.close()
