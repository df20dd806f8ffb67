"""The own forward's elementwise kernels (`vattn.binding`: rms_norm, silu_mul, rotate) against
transformers' operators: rotate exact, RMSNorm and SiLU·up within float32
rounding, on one thread and several, and every input they must refuse."""
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import vattn.binding as binding


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


def bad_calls():
    x, w = torch.randn(4, 64), torch.randn(64)
    return [
        ("a float16 row", lambda: binding.rms_norm(x.half(), w, 1e-5), "float32 rows"),
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
