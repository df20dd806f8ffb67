"""vattn's own CPU attention, `vattn._native.attend`, over the virtual cache's
strided views, read in place: one call a layer for the whole forward, every
decode token and prefill chunk a request reading its slot's rows up to its
own length (bottom-right causal) and no further, so it never touches an
unmapped row.  In the engine the same call first stores the forward's new
K/V at each request's rows (the cache has checked them).  Grouped K/V heads
are read once for all their query heads; float32 and bfloat16, summed in
float32; torch's thread count.
"""
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from vattn import _native

if TYPE_CHECKING:
    from vattn.attention.metadata import StepBatch

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C core's codes
MAX_HEAD_DIM = 256


def serves_head_dim(head_dim: int) -> bool:
    return head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


def requests(rows: Iterable[tuple[int, int, int, int, int]]) -> array:
    """The request table `attend` reads: (slot, start, length, q_first, num_q)
    per request; its `num_q` queries are q's rows q_first.. and its last tokens."""
    table = array("q")
    for row in rows:
        table.extend(row)
    return table


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: array, scale: float,
           window: int | None = None, out: torch.Tensor | None = None, new_k: torch.Tensor | None = None,
           new_v: torch.Tensor | None = None) -> torch.Tensor:
    """`q`, `out [T, H, D]`; `k`, `v [slots, rows, H_kv, D]` (any strides, the
    last dimension contiguous).  Query token i of a request at position p
    attends to rows [max(start, p + 1 - window), p] of its slot.  Rows of
    `out` no request names are left as they are.  With `new_k`, `new_v
    [T, H_kv, D]`, each query token's K/V row is first stored at its position
    in its slot.  A ValueError, with nothing written, for inputs the kernel
    cannot take."""
    out = torch.empty_like(q) if out is None else out
    new = () if new_k is None and new_v is None else (view("new_k", new_k, 3), view("new_v", new_v, 3))
    _native.attend(view("q", q, 3), view("out", out, 3), view("k", k, 4), view("v", v, 4), table, scale,
                   window or 0, torch.get_num_threads(), *new)
    return out


def run(b: "StepBatch", layer: int, q, k, v, scaling, window, out) -> None:
    """`q`, `out [T, H, D]`, `k`/`v [T, H_kv, D]` of the whole forward: stores
    k/v in the cache, and attends."""
    K, V = b.cache.layer_kv(layer)
    attend(q, K, V, b.requests(), scaling, window, out, k, v)


def view(name: str, t: torch.Tensor, ndim: int) -> tuple:
    """What the C core reads of a tensor: address, dtype code, sizes, strides."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: the native kernel runs on the host")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} is {t.dtype}: the native kernel reads float32 or bfloat16")
    if t.dim() != ndim:
        raise ValueError(f"{name} has {t.dim()} dimensions; q and out take [T, H, D], k and v [slots, rows, H_kv, D]")
    return (t.data_ptr(), DTYPES[t.dtype], *t.shape, *t.stride())
