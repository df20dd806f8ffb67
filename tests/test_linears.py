"""The served model's linears: packed and fused GEMMs compute what the model's
own linears do, the engine's tokens stay HF generate()'s with each switch on
and off, and the model comes back bit for bit."""
import os

import pytest
import torch
from test_backend import resident_kb
from test_engine import PER_LAYER_GROUP, engine_for, greedy, hf_greedy, prompts, run
from tiny_models import SMALL, TINY, tiny_model
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from vattn import SamplingParams, _native
import vattn.executor.gemm as gemm
from vattn.executor.linears import Linear, Merged, Part, serve_linears

ON, OFF = True, False
SWITCHES = [dict(pack_linears=p, native_gemm=n, fuse_projections=f, own_forward=o, fuse_elementwise=e)
            for p, n, f, o, e in [
                (ON, ON, ON, ON, ON), (ON, OFF, ON, ON, ON), (ON, ON, ON, ON, OFF), (ON, ON, OFF, ON, ON),
                (OFF, ON, ON, ON, ON), (OFF, ON, OFF, ON, OFF), (ON, ON, ON, OFF, ON), (OFF, ON, OFF, OFF, OFF)]]
SWITCH_IDS = [f"pack={int(s['pack_linears'])}-native={int(s['native_gemm'])}-fuse={int(s['fuse_projections'])}"
              f"-own={int(s['own_forward'])}-elementwise={int(s['fuse_elementwise'])}" for s in SWITCHES]


def snapshot(model):
    """Every parameter and buffer by name: the object and a copy of its values."""
    return {n: (t, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_unchanged(model, before, modules):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, (t, values) in before.items():
        assert after[name][0] is t and torch.equal(t, values), name
    assert [(n, type(m)) for n, m in model.named_modules()] == modules


def unknown_architecture():
    """Qwen3: Q/K/V and gate/up like Llama's, but not among the architectures the fusion knows."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16)).eval()


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("pack, fuse, native", [(True, True, True), (True, True, False), (True, False, True),
                                                (False, True, True)])
def test_served_linears_compute_the_same_and_restore_bit_for_bit(arch, pack, fuse, native):
    model = tiny_model(arch, "sdpa")
    ids = torch.tensor([prompts([30])[0]])
    with torch.inference_mode():
        expected = model(ids).logits
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    served = serve_linears(model, pack, fuse, native_gemm=native)
    layers = SMALL["num_hidden_layers"]
    # per layer: Q/K/V and gate/up as one GEMM each when fused; packed, the others too (2 or 7) and the LM head
    assert served.num_gemms == 2 * layers * fuse + ((2 if fuse else 7) * layers + 1) * pack
    assert served.num_packed == (served.num_gemms if pack else 0)
    packing = None if not pack else "native" if native and _native.linear_serves(False) else "onednn"
    assert {m.packing for m in served.served} <= {packing}
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Part if fuse else Linear) and isinstance(attn.o_proj, Linear if pack else nn.Linear)
    # the originals' storage is let go (tiny models do not tie the LM head; their weights are anonymous memory)
    assert served.held_twice == 0 and served.paged_out == 0 and all(w.numel() == 0 for w, _, _ in served.released)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    gemms = list(served.served)
    served.restore()
    assert_unchanged(model, before, modules)
    assert all(m.nbytes == 0 for m in gemms)  # each served weight let go once unpacked
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)


def test_a_tied_lm_head_is_kept_beside_its_packed_copy():
    config = TINY["llama"][0](**SMALL, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = TINY["llama"][1](config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    served = serve_linears(model)
    head = model.model.embed_tokens.weight
    assert head.numel() == SMALL["vocab_size"] * SMALL["hidden_size"]  # the embedding still reads it
    assert served.held_twice == head.numel() * head.element_size()
    served.restore()
    assert_unchanged(model, before, modules)


def whole_pages(t: torch.Tensor) -> int:
    """Bytes of the whole OS pages inside t's memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    return max(0, ((t.data_ptr() + t.nbytes) // page - -(-t.data_ptr() // page)) * page)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_read_from_a_mapped_file_give_their_pages_back(tmp_path, tied):
    """Every packed linear's original pages, the tied embedding's too (only
    its looked-up rows are read again)."""
    config = TINY["llama"][0](**SMALL, tie_word_embeddings=tied)
    torch.manual_seed(0)
    TINY["llama"][1](config).save_pretrained(tmp_path)
    os.sync()  # clean pages, as in a file written long before it is loaded
    model = TINY["llama"][1].from_pretrained(tmp_path, dtype=torch.float32).eval()  # safetensors maps the file
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.tensor([prompts([30])[0]])
    with torch.inference_mode():
        expected = model(ids).logits  # every weight read in
    path = tmp_path / "model.safetensors"
    resident = resident_kb(path)
    originals = {m.weight.data_ptr(): m.weight for m in model.modules() if type(m) is nn.Linear}
    pages = sum(map(whole_pages, originals.values()))
    served = serve_linears(model)
    assert served.paged_out == pages > 0
    assert resident_kb(path) <= resident - served.paged_out // 2048  # at least half of it gone
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)
    served.restore()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)


def test_a_fused_part_recomputes_when_called_out_of_pattern():
    torch.manual_seed(0)
    linears = [nn.Linear(8, n, bias=True) for n in (4, 2, 2)]
    group = Merged(linears, pack=True, rows=4)
    parts = [Part(group, i) for i in range(3)]
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        expect = lambda i, t: linears[i](t)  # noqa: E731
        torch.testing.assert_close(parts[1](x), expect(1, x))  # the first to ask computes for all
        torch.testing.assert_close(parts[1](x), expect(1, x))  # asking twice computes again
        torch.testing.assert_close(parts[0](y), expect(0, y))  # another input
        torch.testing.assert_close(parts[2](x), expect(2, x))  # back to the first one
        x.mul_(2)  # changed in place: its version moves on
        torch.testing.assert_close(parts[0](x), expect(0, x))
        torch.testing.assert_close(parts[1](x), expect(1, x))
        torch.testing.assert_close(parts[2](x), expect(2, x))
    assert group._output is None  # every part read it: let go


def test_fusion_skips_what_does_not_match():
    model = tiny_model("llama", "sdpa")
    attn = model.model.layers[0].self_attn
    attn.k_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=True)  # a bias the others lack
    served = serve_linears(model, pack=False, fuse=True)
    assert type(attn.k_proj) is nn.Linear and type(attn.q_proj) is nn.Linear  # that layer's Q/K/V run unfused
    assert isinstance(model.model.layers[1].self_attn.q_proj, Part)
    served.restore()


@pytest.mark.parametrize("settings", SWITCHES, ids=SWITCH_IDS)
@pytest.mark.parametrize("arch", list(TINY))
def test_engine_equals_hf_generate_with_each_switch(arch, settings):
    model = tiny_model(arch, "sdpa")
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    for extra in ({}, dict(layout="per_layer", memory_budget=4 * PER_LAYER_GROUP, preemption_mode="swap"),
                  dict(layout="per_layer", memory_budget=4 * PER_LAYER_GROUP, preemption_mode="recompute")):
        engine = engine_for(model, **settings, **extra)
        assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
        assert (engine.stats.preemptions > 0) == bool(extra)
        engine.close()
        assert_unchanged(model, before, modules)


@pytest.mark.parametrize("settings", SWITCHES, ids=SWITCH_IDS)
def test_prefix_hits_and_parallel_samples_with_each_switch(settings):
    model = tiny_model("llama", "sdpa")
    system, a, b = prompts([100, 9, 12])
    expected = [hf_greedy(model, system + q, 12) for q in (a, b)]
    engine = engine_for(model, max_num_batched_tokens=128, **settings)
    assert run(engine, [(system + a, greedy(12))]) == [[expected[0]]]
    assert run(engine, [(system + b, greedy(12))]) == [[expected[1]]]
    assert engine.scheduler.prefix_hit_tokens == 64
    [samples] = run(engine, [(system, SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=3))])
    lone = engine_for(model, max_num_batched_tokens=128, pack_linears=False, fuse_projections=False,
                      own_forward=False)
    for i, sample in enumerate(samples):  # each sample is its seed's, whatever GEMMs ran
        assert run(lone, [(system, SamplingParams(max_tokens=12, temperature=0.8, seed=3 + i))]) == [[sample]]
    engine.close()
    lone.close()


def test_an_architecture_the_fusion_does_not_know_is_served_unfused():
    model = unknown_architecture()
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    engine = engine_for(model)
    served = engine.runner.linears
    assert served.num_gemms == served.num_packed == SMALL["num_hidden_layers"] * 7 + 1  # packed, one by one
    assert not any(isinstance(m, Part) for m in model.modules())
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    engine.close()
    assert all(type(m) is not Linear for m in model.modules())


@pytest.mark.parametrize("settings, message", [
    (dict(pack_linears="yes"), "pack_linears must be a bool"), (dict(fuse_projections=1), "fuse_projections"),
    (dict(compile="yes"), "compile must be a bool"), (dict(attention="fastest"), "fastest"),
    (dict(own_forward="yes"), "own_forward must be a bool"),
    (dict(fuse_elementwise=None), "fuse_elementwise must be a bool"),
    (dict(native_gemm="onednn"), "native_gemm must be a bool"),
])
def test_bad_settings_leave_the_model_untouched(settings, message):
    model = tiny_model("llama", "sdpa")
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match=message):
        engine_for(model, **settings)
    assert_unchanged(model, before, modules)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("native", [True, False])
def test_a_failure_part_way_leaves_the_model_as_it_was(monkeypatch, native):
    model = tiny_model("qwen2", "sdpa")
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    calls = []
    owner, name = (gemm, "pack") if native and _native.linear_serves(False) else (torch.ops.mkldnn, "_reorder_linear_weight")
    pack = getattr(owner, name)

    def failing(weight, *rows):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("no memory for the packed weight")
        return pack(weight, *rows)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(RuntimeError, match="packed weight"):
        serve_linears(model, native_gemm=native)
    assert len(calls) == 5
    assert_unchanged(model, before, modules)


def test_a_compiled_model_gives_the_same_tokens_from_one_graph():
    from torch._dynamo.utils import counters

    model = tiny_model("qwen2", "sdpa")
    reference = [hf_greedy(model, p, 40) for p in prompts()]
    before, modules = snapshot(model), [(n, type(m)) for n, m in model.named_modules()]
    graphs = counters["stats"]["unique_graphs"]
    engine = engine_for(model, compile=True, max_num_batched_tokens=24)
    assert engine.runner.linears.num_gemms == 0  # inductor packs the weights itself
    assert run(engine, [(p, greedy()) for p in prompts()]) == [[r] for r in reference]
    tokens = set(engine.stats.tokens)
    assert 1 in tokens and len(tokens) >= 4  # steps of one token and of many, one graph for all
    assert counters["stats"]["unique_graphs"] - graphs == 1
    engine.close()
    assert_unchanged(model, before, modules)
