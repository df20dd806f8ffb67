"""vattn's own GEMM (`vattn.executor.gemm`) against float64 arithmetic, in
float32 and bfloat16 on every instruction set this CPU runs: every block
size and a partial last panel, more rows than a chunk, strided input rows,
with and without a bias, on one thread and two; the packing undone bit for
bit; and every input it must refuse, refused before it writes.  (Its gated
form: test_forward's one-call decoder.)"""
import pytest
import torch
import torch.nn.functional as F
from test_elementwise import forced, runnable_isas, threads

from vattn import _native, dtypes
import vattn.executor.gemm as gemm
from vattn.binding import rows as matrix


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def close(got, want, in_features):
    """float32: within float32 sums' rounding; bfloat16: one rounding of the float32 result besides."""
    if got.dtype == torch.bfloat16:
        assert ((got.double() - want).abs() <= want.abs() / 128 + 1e-5 * in_features ** 0.5).all()
    else:
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 8, 9, 40, 197, 400])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (50, 33), (48, 1)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_linear_equals_float64_within_rounding(isa, dtype, rows, out_features, in_features, n_threads):
    g = torch.Generator().manual_seed(rows * out_features)
    w, b = (torch.randn(out_features, in_features, generator=g).to(dtype),
            torch.randn(out_features, generator=g).to(dtype))
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    panels = gemm.pack(w)
    depth = in_features + in_features % 2 if dtype == torch.bfloat16 else in_features  # bfloat16: in pairs
    assert panels.shape == (-(-out_features // gemm.PANEL), depth, gemm.PANEL)
    with forced(isa), threads(n_threads):
        for bias in (None, b):
            got = gemm.linear(x, panels, out_features, bias)
            assert got.shape == (rows, out_features) and got.dtype == dtype
            close(got, reference(x, w, bias), in_features)


def test_rows_any_stride_apart_and_leading_dimensions():
    w = torch.randn(100, 64)
    wide = torch.randn(2, 5, 128)
    x = wide[..., :64]  # rows 128 floats apart
    got = gemm.linear(x, gemm.pack(w), 100)
    assert got.shape == (2, 5, 100)
    close(got, reference(x, w, None), 64)
    columns = torch.randn(7, 128)[:, ::2]  # a strided last dimension is copied first
    close(gemm.linear(columns, gemm.pack(w), 100), reference(columns, w, None), 64)


def test_panels_and_rows_at_any_address():
    w, x = torch.randn(96, 64), torch.randn(5, 65)[:, 1:]  # rows 4 bytes past a 64-byte boundary
    panels = gemm.pack(w)
    shifted = torch.empty(panels.numel() + 1)[1:].view(panels.shape)
    shifted.copy_(panels)
    close(gemm.linear(x, shifted, 96), reference(x, w, None), 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [1, 47, 48, 49, 3072])
@pytest.mark.parametrize("in_features", [33, 64])
def test_unpack_gives_the_weight_back_bit_for_bit(dtype, out_features, in_features):
    w = torch.randn(out_features, in_features).to(dtype)
    panels = gemm.pack(w)
    assert torch.equal(gemm.unpack(panels, out_features, in_features), w)
    padded = gemm.unpack(panels, panels.shape[0] * gemm.PANEL, panels.shape[1])
    assert torch.count_nonzero(padded[out_features:]) == 0 and torch.count_nonzero(padded[:, in_features:]) == 0
    if dtype == torch.bfloat16:  # each column's inputs in pairs: panel 0, pair 0, column 0 holds inputs 0 and 1
        assert torch.equal(panels.view(-1)[:2], w[0, :2])


def test_it_serves_float32_with_avx512_and_bfloat16_with_avx512_bf16_without_amx_or_where_onednn_does_not_pack_it():
    assert gemm.serves(torch.randn(4, 4)) == _native.linear_serves(False)
    paired = _native.linear_serves(True)
    assert paired == (dtypes.cpu_bf16() == ("avx512_bf16",))
    assert gemm.serves(torch.randn(4, 4, dtype=torch.bfloat16)) == (
        paired or not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not gemm.serves(torch.randn(4, 4, dtype=torch.float16))
    assert not gemm.serves(torch.randn(4, 4, device="meta"))


def raw(out, x, panels, bias=None):
    """The native call itself, past `gemm.linear`'s shaping."""
    return _native.linear(matrix("out", out), matrix("x", x), matrix("panels", panels), bias, 1)


def bad_calls():
    w, x = torch.randn(96, 64), torch.randn(5, 64)
    panels = gemm.pack(w).view(-1, gemm.PANEL)
    return [
        ("inputs of another width", lambda out: raw(out, x[:, :32], panels), "32 inputs take 64 x 48"),
        ("panels of another width", lambda out: raw(out, x, torch.randn(128, 32)), "panels are 128 x 32"),
        ("fewer panels than the outputs need", lambda out: raw(out, x, panels[:64]), "panels are 64 x 48"),
        ("a bias of another length", lambda out: raw(out, x, panels, matrix("bias", torch.randn(95))),
         "bias is 1 x 95"),
        ("an out of other rows", lambda out: raw(out[:4], x, panels), "out has 4 rows; x has 5"),
        ("bfloat16 rows, float32 panels", lambda out: gemm.linear(x.bfloat16(), panels.view(-1, 64, gemm.PANEL), 96),
         "one dtype"),
        ("bfloat16 panels of another pair count", lambda out: raw(out.bfloat16(), torch.randn(5, 62).bfloat16(),
                                                                  gemm.pack(w.bfloat16()).view(-1, gemm.PANEL)),
         "62 inputs take 124 x 48"),
        ("not a matrix", lambda out: _native.linear((0, 1), matrix("x", x), matrix("panels", panels), None, 1),
         "expected \\(address, dtype, rows"),
    ]


@pytest.mark.parametrize("what, call, message", bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_input_raises_and_writes_nothing(what, call, message):
    out = torch.full((5, 96), 7.0)
    with pytest.raises((ValueError, TypeError), match=message):
        call(out)
    assert torch.equal(out, torch.full((5, 96), 7.0))
