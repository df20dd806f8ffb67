"""The engine forward's elementwise work between its GEMMs, one native call
each (`native/ops.c`), over float32 rows on the host: RMSNorm with the
residual add before it, SiLU(gate)·up, and the rotary embedding in place.

transformers' modules spend two to eight operators on each, and on this
kind of CPU every operator after a GEMM pays again for its code and data,
which the GEMM's weights pushed out of the caches; one call pays once.
`rotate` rounds as transformers does and is exact; `rms_norm` sums and
`silu_mul` exponentiates in vattn's own order, equal within a few units in
the last place.
"""
import torch

from vattn import _native

MAX_HEAD_DIM = 256  # rotate's


def serves(t: torch.Tensor) -> bool:
    """Whether these kernels take rows of `t`'s dtype and device."""
    return t.dtype == torch.float32 and t.is_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x [T, n]` <- `weight · x / rms(x)`, in place; with `residual`, first
    `residual += x` and x becomes the norm of that sum.  Returns x."""
    _native.rms_norm(matrix("x", x), None if residual is None else matrix("residual", residual),
                     matrix("weight", weight), eps, torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) · up` `[T, n]` of `gate_up [T, 2n]` (gate first), into `out` where given."""
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _native.silu_mul(matrix("out", out), matrix("gate_up", gate_up), torch.get_num_threads())
    return out


def rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """The rotary embedding of `x [T, heads · D]`'s heads in place,
    `x·cos + [x2, x1]·signed_sin` with `cos`, `signed_sin [T, D]`."""
    _native.rotate(matrix("x", x), heads, matrix("cos", cos), matrix("sin", signed_sin), torch.get_num_threads())


def matrix(name: str, t: torch.Tensor) -> tuple[int, int, int, int]:
    """(address, rows, columns, row stride) of float32 rows on the host, each
    contiguous (a vector is one row)."""
    if (not isinstance(t, torch.Tensor) or not serves(t) or t.dim() not in (1, 2)
            or (t.stride(-1) != 1 and t.shape[-1] > 1)):
        raise ValueError(f"{name} must be float32 rows on the host, each contiguous; got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} "
                         f"on {getattr(t, 'device', '?')}")
    if t.dim() == 1:
        return t.data_ptr(), 1, t.shape[0], t.shape[0]
    return t.data_ptr(), t.shape[0], t.shape[1], t.stride(0)
