"""vattn's own float32 GEMM (`vattn.executor.gemm`) against float64 arithmetic:
every block size and a partial last panel, more rows than a chunk, strided
input rows, with and without a bias, on one thread and two; the packing
undone bit for bit; and every input it must refuse, refused before it
writes."""
import pytest
import torch
import torch.nn.functional as F
from test_elementwise import threads

from vattn import _native
import vattn.executor.gemm as gemm
from vattn.binding import rows as matrix

pytestmark = pytest.mark.skipif(not _native.linear_serves(), reason="the native GEMM needs AVX-512")


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 40, 197, 400])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (50, 33), (48, 1)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_linear_equals_float64_within_rounding(rows, out_features, in_features, n_threads):
    g = torch.Generator().manual_seed(rows * out_features)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    panels = gemm.pack(w)
    assert panels.shape == (-(-out_features // gemm.PANEL), in_features, gemm.PANEL)
    with threads(n_threads):
        for bias in (None, b):
            got = gemm.linear(x, panels, out_features, bias)
            assert got.shape == (rows, out_features)
            torch.testing.assert_close(got, reference(x, w, bias), rtol=1e-5, atol=1e-5 * in_features ** 0.5)


def test_rows_any_stride_apart_and_leading_dimensions():
    w = torch.randn(100, 64)
    wide = torch.randn(2, 5, 128)
    x = wide[..., :64]  # rows 128 floats apart
    got = gemm.linear(x, gemm.pack(w), 100)
    assert got.shape == (2, 5, 100)
    torch.testing.assert_close(got, reference(x, w, None), rtol=1e-5, atol=1e-4)
    columns = torch.randn(7, 128)[:, ::2]  # a strided last dimension is copied first
    torch.testing.assert_close(gemm.linear(columns, gemm.pack(w), 100), reference(columns, w, None), rtol=1e-5,
                               atol=1e-4)


def test_panels_and_rows_at_any_address():
    w, x = torch.randn(96, 64), torch.randn(5, 65)[:, 1:]  # rows 4 bytes past a 64-byte boundary
    panels = gemm.pack(w)
    shifted = torch.empty(panels.numel() + 1)[1:].view(panels.shape)
    shifted.copy_(panels)
    torch.testing.assert_close(gemm.linear(x, shifted, 96), reference(x, w, None), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("out_features", [1, 47, 48, 49, 3072])
def test_unpack_gives_the_weight_back_bit_for_bit(out_features):
    w = torch.randn(out_features, 33)
    panels = gemm.pack(w)
    assert torch.equal(gemm.unpack(panels, out_features), w)
    assert torch.count_nonzero(panels.transpose(1, 2).reshape(-1, 33)[out_features:]) == 0  # zeros past the last


def test_serves_float32_on_the_host_only():
    assert gemm.serves(torch.randn(4, 4))
    assert not gemm.serves(torch.randn(4, 4, dtype=torch.bfloat16))
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
        ("bfloat16 rows", lambda out: gemm.linear(x.bfloat16(), panels.view(-1, 64, gemm.PANEL), 96), "float32"),
        ("not a matrix", lambda out: _native.linear((0, 1), matrix("x", x), matrix("panels", panels), None, 1),
         "expected \\(address, rows"),
    ]


@pytest.mark.parametrize("what, call, message", bad_calls(), ids=[b[0] for b in bad_calls()])
def test_bad_input_raises_and_writes_nothing(what, call, message):
    out = torch.full((5, 96), 7.0)
    with pytest.raises((ValueError, TypeError), match=message):
        call(out)
    assert torch.equal(out, torch.full((5, 96), 7.0))
