"""The engine's own forward (`vattn.engine.forward`): the model's logits bit
for bit on every step (within float32 rounding with its elementwise work
fused), and the model's own forward wherever it would not be transformers'
arithmetic."""
import pytest
import torch
from test_engine import engine_for, greedy, hf_greedy, prompts, run
from test_linears import unknown_architecture
from tiny_models import SMALL, TINY, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from vattn import SamplingParams
from vattn.engine.forward import DecoderForward


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

    def both(ids, positions, rows, batch):
        logits = own(ids, positions, rows, batch)
        equal.append(same(logits, runner._model_logits(ids[None], rows, batch)))  # rewrites the step's K/V
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
    engine = engine_for(model, fuse_elementwise=fuse, **settings)
    assert engine.runner.decoder is not None and engine.runner.decoder.fused == fuse
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
    assert set(seen[0]) == {"qkv", "attention", "sampling", "residual", "o", "gate_up", "act", "down", "logits"}
    # grown at most while both requests start (their prefill, then both sampling); reused since
    assert len(seen) > 10 and all(buffers == seen[2] for buffers in seen[2:])


@pytest.mark.parametrize("arch", list(TINY))
def test_the_engine_equals_hf_generate_with_and_without_its_own_forward(arch):
    model = tiny_model(arch, "sdpa")
    reference = [[hf_greedy(model, p, 40)] for p in prompts()]
    for own, fuse in ((True, True), (True, False), (False, True)):
        engine = engine_for(model, own_forward=own, fuse_elementwise=fuse)
        assert (engine.runner.decoder is not None) == own
        assert run(engine, [(p, greedy()) for p in prompts()]) == reference
        engine.close()


def test_the_fused_forward_serves_float32_on_the_host_only():
    """bfloat16 rows run the exact forward: the fused kernels take float32."""
    model = tiny_model("llama", "sdpa").to(torch.bfloat16)
    engine = engine_for(model)
    assert engine.runner.decoder is not None and not engine.runner.decoder.fused
    engine.close()


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
