"""The own forward's elementwise kernels (`vattn.binding`: rms_norm, silu_mul, rotate) against
transformers' operators: rotate exact, RMSNorm and SiLU·up within float32
rounding, on one thread and several; in bfloat16 against transformers' own
modules in bfloat16 (rounding where they round) on every instruction set this
CPU runs; and every input they must refuse."""
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import vattn.binding as binding

def runnable_isas() -> list[str]:
    """The instruction sets this CPU runs (`binding.isa` refuses the others)."""
    best, found = binding.isa(), []
    for isa in ("amx", "avx512_bf16", "avx512", "avx2", "baseline"):
        try:
            binding.isa(isa)
            found.append(isa)
        except ValueError:
            pass
    binding.isa(best)
    return found


@contextmanager
def forced(isa):
    best = binding.isa()
    binding.isa(isa)
    try:
        yield
    finally:
        binding.isa(best)


@contextmanager
def threads(n):
    """n torch threads inside (the kernels share out rows past 65,536 floats)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_rms_norm_with_and_without_the_residual(rows, n_threads):
    g = torch.Generator().manual_seed(rows)
    h, x, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.randn(576, generator=g)
    with threads(n_threads):
        alone = binding.rms_norm(x.clone(), w, 1e-5)
        residual, out = h.clone(), x.clone()
        assert binding.rms_norm(out, w, 1e-5, residual) is out
    torch.testing.assert_close(alone, F.rms_norm(x, (576,), w, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(residual, h + x)  # the sum is exact
    torch.testing.assert_close(out, F.rms_norm(h + x, (576,), w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows, width", [(1, 1536), (7, 40), (300, 1536), (3, 17)])
def test_silu_mul_equals_silu_of_gate_times_up(rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 6
    with threads(2):
        out = binding.silu_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate_up[:, :width]) * gate_up[:, width:], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 9, 400])
@pytest.mark.parametrize("dim", [64, 6, 128])
def test_rotate_is_transformers_arithmetic_bit_for_bit(rows, dim):
    """Q and K heads of a Q/K/V row rotated in place; V's columns untouched."""
    g = torch.Generator().manual_seed(dim)
    qkv, cos, sin = torch.randn(rows, 5 * dim, generator=g), torch.randn(rows, dim, generator=g), torch.randn(
        rows, dim, generator=g)
    x, v = qkv[:, :4 * dim].reshape(rows, 4, dim), qkv[:, 4 * dim:].clone()
    half = dim // 2
    expected = x * cos[:, None] + torch.cat((x[..., half:], x[..., :half]), -1) * sin[:, None]
    with threads(2):
        binding.rotate(qkv[:, :4 * dim], 4, cos, sin)
    assert torch.equal(qkv[:, :4 * dim].reshape(rows, 4, dim), expected)
    assert torch.equal(qkv[:, 4 * dim:], v)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_bfloat16_kernels_round_where_transformers_rounds(isa, rows):
    """transformers' RMSNorm and the residual add, SiLU·up and the rotary
    embedding run in bfloat16: the kernels give their bits but where the
    norm's float32 sum or exp round differently (then one bfloat16 step)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(rows)
    bf = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).bfloat16()  # noqa: E731
    h, x, dim = bf(rows, 576), bf(rows, 576), 64
    norm = LlamaRMSNorm(576, eps=1e-5).bfloat16()
    norm.weight.data = bf(576)
    gate_up, qk, cos, sin = bf(rows, 2 * 1536, scale=4), bf(rows, 4 * dim), bf(rows, dim), bf(rows, dim)
    with forced(isa), threads(2):
        residual, out = h.clone(), x.clone()
        binding.rms_norm(out, norm.weight, 1e-5, residual)
        act = binding.silu_mul(gate_up)
        rotated = qk.clone()
        binding.rotate(rotated, 4, cos, sin)
    assert torch.equal(residual, h + x)
    step = lambda t: t.float().abs().clamp(min=1e-30) / 128  # noqa: E731  (one bfloat16 step at t)
    assert ((out.float() - norm(h + x).float()).abs() <= step(norm(h + x))).all()
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    assert ((act.float() - expected.float()).abs() <= step(expected)).all()
    heads = qk.view(rows, 4, dim)
    assert torch.equal(rotated.view(rows, 4, dim), heads * cos[:, None] + torch.cat(
        (heads[..., dim // 2:], heads[..., :dim // 2]), -1) * sin[:, None])


@pytest.mark.parametrize("isa", runnable_isas())
def test_float32_kernels_on_every_instruction_set(isa):
    g = torch.Generator().manual_seed(3)
    x, w, gate_up = torch.randn(9, 576, generator=g), torch.randn(576, generator=g), torch.randn(9, 80, generator=g)
    with forced(isa):
        out = binding.rms_norm(x.clone(), w, 1e-5)
        act = binding.silu_mul(gate_up)
    torch.testing.assert_close(out, F.rms_norm(x, (576,), w, 1e-5), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(act, F.silu(gate_up[:, :40]) * gate_up[:, 40:], rtol=2e-6, atol=1e-6)


def test_an_instruction_set_the_cpu_lacks_is_refused():
    best = binding.isa()
    with pytest.raises(ValueError, match="this CPU runs"):
        binding.isa("avx1024")
    assert binding.isa() == best


def bad_calls():
    x, w = torch.randn(4, 64), torch.randn(64)
    return [
        ("a float16 row", lambda: binding.rms_norm(x.half(), w, 1e-5), "float32 or bfloat16 rows"),
        ("rows of two dtypes", lambda: binding.rms_norm(x.bfloat16(), w, 1e-5), "one dtype"),
        ("silu_mul of two dtypes", lambda: binding.silu_mul(torch.randn(4, 8), torch.empty(4, 4).bfloat16()),
         "one dtype"),
        ("rows whose last dimension is strided", lambda: binding.rms_norm(torch.randn(4, 128)[:, ::2], w, 1e-5),
         "each contiguous"),
        ("a weight of another width", lambda: binding.rms_norm(x, torch.randn(32), 1e-5), "weight is 1 x 32"),
        ("a residual of another shape", lambda: binding.rms_norm(x, w, 1e-5, torch.randn(3, 64)), "residual is 3 x 64"),
        ("an odd-width gate_up", lambda: binding.silu_mul(torch.randn(4, 33)), "half as wide"),
        ("heads that do not divide a row", lambda: binding.rotate(x, 3, x[:, :21], x[:, :21]), "do not split"),
        ("an odd head dim", lambda: binding.rotate(torch.randn(4, 30), 2, x[:, :15], x[:, :15]), "even"),
        ("cos of other rows", lambda: binding.rotate(x, 1, torch.randn(3, 64), torch.randn(3, 64)), "cos and sin"),
        ("a tensor on another device", lambda: binding.silu_mul(torch.randn(4, 8, device="meta")), "on meta"),
        ("not a tensor", lambda: binding.rms_norm([1.0], w, 1e-5), "got list"),
    ]


@pytest.mark.parametrize("what, call, message", bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_input_raises_and_writes_nothing(what, call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_refused_norm_leaves_its_rows_as_they_were():
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    before = x.clone(), residual.clone()
    with pytest.raises(ValueError, match="weight"):
        binding.rms_norm(x, torch.randn(65), 1e-5, residual)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
