"""The C core (`vattn._native`, built from `native/`), bound in one place:
every call into it, and the packing of its arguments.

A tensor goes to C as a *view* (address, dtype code, sizes, strides: what
the attention kernel reads) or as *rows* (address, dtype code, rows, columns,
row stride of rows on the host: what the elementwise kernels read, and the
GEMM in float32);
the one-call decoder's layers as `DecoderLayer` records.  The C core checks
every argument again and raises ValueError, with nothing written, for one it
cannot take.
"""
from array import array
from collections.abc import Iterable
from typing import NamedTuple

import torch

import vattn._native as c

# ------------------------------------------------------------ the VMM (native/vmm.c): host backend's calls

MapLimitError = c.MapLimitError  # the process's limit on mappings (vm.max_map_count) refused a map
Reservation, PhysicalFile = c.Reservation, c.PhysicalFile
os_page_size, map_pages, unmap_pages, punch_pages = c.os_page_size, c.map_pages, c.unmap_pages, c.punch_pages
page_out, trim_heap, raw_map_loop, dlpack = c.page_out, c.trim_heap, c.raw_map_loop, c.dlpack

# ------------------------------------------------------------ arguments

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' dtype codes
isa = c.isa  # ([name]) -> the instruction set the attention and elementwise kernels run, forced to name first


def view(name: str, t: torch.Tensor, ndim: int) -> tuple:
    """What the attention kernel reads of a tensor on the host: address, dtype code, sizes, strides."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: the native kernel runs on the host")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} is {t.dtype}: the native kernel reads float32 or bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} has {t.dim()} dimensions; q and out take [T, H, D], k and v [slots, rows, H_kv, D]")
    return (t.data_ptr(), DTYPES[t.dtype], *t.shape, *t.stride())


def serves_rows(t: torch.Tensor) -> bool:
    """Whether the C kernels take rows of `t`'s dtype and device."""
    return t.dtype in DTYPES and t.is_cpu


def rows(name: str, t: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(address, dtype code, rows, columns, row stride) of float32 or
    bfloat16 rows on the host, each contiguous (a vector is one row)."""
    if (not isinstance(t, torch.Tensor) or not serves_rows(t) or t.dim() not in (1, 2)
            or (t.stride(-1) != 1 and t.shape[-1] > 1)):
        raise ValueError(f"{name} must be float32 or bfloat16 rows on the host, each contiguous; got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} "
                         f"on {getattr(t, 'device', '?')}")
    if t.dim() == 1:
        return t.data_ptr(), DTYPES[t.dtype], 1, t.shape[0], t.shape[0]
    return t.data_ptr(), DTYPES[t.dtype], t.shape[0], t.shape[1], t.stride(0)


def request_table(requests: Iterable[tuple[int, int, int, int, int]]) -> array:
    """The request table `attend` reads: (slot, start, length, q_first, num_q)
    per request; its `num_q` queries are q's rows q_first.. and its last tokens."""
    table = array("q")
    for request in requests:
        table.extend(request)
    return table


# ------------------------------------------------------------ attention (native/attention.c)

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: array, scale: float,
           window: int | None = None, out: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
           new_v: torch.Tensor | None = None) -> torch.Tensor:
    """`q`, `out [T, H, D]`; `k`, `v [slots, rows, H_kv, D]` (any strides, the
    last dimension contiguous).  Query token i of a request at position p
    attends to rows [max(start, p + 1 - window), p] of its slot.  Rows of
    `out` no request names are left as they are.  With `new_k`, `new_v
    [T, H_kv, D]`, each query token's K/V row is first stored at its position
    in its slot."""
    out = torch.empty_like(q) if out is None else out
    new = () if new_k is None and new_v is None else (view("new_k", new_k, 3), view("new_v", new_v, 3))
    c.attend(view("q", q, 3), view("out", out, 3), view("k", k, 4), view("v", v, 4), table, scale, window or 0,
             torch.get_num_threads(), *new)
    return out


# ------------------------------------------------------------ elementwise (native/ops.c)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`x [T, n]` <- `weight · x / rms(x)`, in place; with `residual`, first
    `residual += x` and x becomes the norm of that sum.  Returns x."""
    c.rms_norm(rows("x", x), None if residual is None else rows("residual", residual), rows("weight", weight), eps,
               torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) · up` `[T, n]` of `gate_up [T, 2n]` (gate first), into `out` where given."""
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    c.silu_mul(rows("out", out), rows("gate_up", gate_up), torch.get_num_threads())
    return out


def rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """The rotary embedding of `x [T, heads · D]`'s heads in place,
    `x·cos + [x2, x1]·signed_sin` with `cos`, `signed_sin [T, D]`."""
    c.rotate(rows("x", x), heads, rows("cos", cos), rows("sin", signed_sin), torch.get_num_threads())


ROTATE_MAX_HEAD_DIM = 256


# ------------------------------------------------------------ the GEMM (native/linear.c)

LINEAR_PANEL = c.LINEAR_PANEL  # output columns a panel of a packed weight holds
linear_serves = c.linear_serves  # (bf16) -> whether weights of that dtype are its to run here


def weight(panels: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """A weight packed in `panels` and its bias, as the GEMM reads them."""
    return rows("panels", panels.view(-1, LINEAR_PANEL)), None if bias is None else rows("bias", bias)


def linear(out: torch.Tensor, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`out [rows, n]` <- `x [rows, in] W^T + bias` of the weight packed in `panels`."""
    c.linear(rows("out", out), rows("x", x), *weight(panels, bias), torch.get_num_threads())


# ------------------------------------------------------------ the one-call decoder (native/decoder.c)

class DecoderLayer(NamedTuple):
    """One decoder layer as `decoder_layers` reads it: packed weights and
    their biases (rows, or None), the norms' weights and epsilons, the
    layer's cache views, its attention scale and window (0: none)."""

    qkv: tuple
    qkv_bias: tuple | None
    o: tuple
    o_bias: tuple | None
    gate_up: tuple
    gate_up_bias: tuple | None
    down: tuple
    down_bias: tuple | None
    input_norm: tuple
    input_eps: float
    post_norm: tuple
    post_eps: float
    k: tuple
    v: tuple
    scale: float
    window: int


def decoder_layer(linears: list[tuple[torch.Tensor, torch.Tensor | None]], norms: list[tuple[torch.Tensor, float]],
                  k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> DecoderLayer:
    """A layer from its four linears' (panels, bias) in call order (qkv, o,
    gate_up, down), its two norms' (weight, eps) (input, post), and its cache
    views `[slots, rows, H_kv, D]`."""
    packed = [arg for panels, bias in linears for arg in weight(panels, bias)]
    (input_norm, input_eps), (post_norm, post_eps) = norms
    return DecoderLayer(*packed, rows("norm", input_norm), input_eps, rows("norm", post_norm), post_eps,
                        view("k", k, 4), view("v", v, 4), scale, window)


STEP_ROWS = ("residual", "x", "qkv", "attention", "o", "gate_up", "act", "down", "cos", "sin")


def decoder_layers(layers: tuple[DecoderLayer, ...], step: dict[str, torch.Tensor], table: array,
                   sampled: torch.Tensor, heads: int) -> None:
    """Every layer of a step's forward in one call: `step` holds the step's
    rows by `STEP_ROWS`' names (the residual stream, each call's output, the
    rotary cos and sin), `table` the attention's requests, `sampled` the
    rising rows whose residual stream is gathered to the top at the end."""
    c.decoder_layers(layers, *(rows(name, step[name]) for name in STEP_ROWS), table, sampled.numpy(), heads,
                     torch.get_num_threads())
