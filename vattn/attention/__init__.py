"""Attention over the KV cache, for the engine's forward passes.

One forward holds several requests back to back (`StepBatch`).  Every layer
writes its new K/V into the cache at each request's own positions and attends
over that request's live tokens only, with the kernel the engine picked
(`registry.pick`, by the device, dtype, cache kind and head dim, or by name):
vattn's own CPU kernel (`native`) for a float32 or bfloat16 virtual cache on
the host, FlashAttention (`flash`) on CUDA with flash-attn installed and a
16-bit virtual cache, else torch SDPA (`sdpa`).

`register()` makes `attention` available to transformers as
`attn_implementation="vattn"`.  It attends for the `StepBatch` of the
forward running inside `step(batch)`, through one torch operator,
`vattn::attention`, so that `torch.compile` traces a model around it without
breaking its graph.  `attend(batch, layer, q, k, v, ...)` is that operator's
work, for a forward that calls it directly (`vattn.engine.forward`).
"""
import threading
from contextlib import contextmanager

import torch

from vattn.attention.flash import flash_attn_with_kvcache  # None without flash-attn; the kernel benchmarks call it
from vattn.attention.metadata import StepBatch
from vattn.attention.sdpa import decode, prefill

__all__ = ["NAME", "StepBatch", "attend", "attention", "decode", "flash_attn_with_kvcache", "prefill", "register",
           "step"]

NAME = "vattn"


_steps = threading.local()  # the StepBatch of the forward each thread runs


@contextmanager
def step(batch: StepBatch):
    """Attention inside this block serves `batch`."""
    outer, _steps.batch = getattr(_steps, "batch", None), batch
    try:
        yield
    finally:
        _steps.batch = outer


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """transformers' attention-interface signature: `query [1, H, T, D]`,
    `key`/`value [1, H_kv, T, D]`; returns `([1, T, H, D], None)`."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attend_step(query, key, value, module.layer_idx, scaling, sliding_window or 0), None


@torch.library.custom_op("vattn::attention", mutates_args=())
def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                window: int) -> torch.Tensor:
    """Write layer `layer`'s K/V of the step into the cache, and attend (`window` 0: none)."""
    b = getattr(_steps, "batch", None)
    if b is None:
        raise RuntimeError('attn_implementation="vattn" runs inside vattn.LLMEngine steps only')
    return attend(b, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scaling,
                  window).unsqueeze(0)


def attend(b: StepBatch, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           window: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer` of the forward `b` describes: its K/V `[T, H_kv, D]` into
    the cache, and `q [T, H, D]`'s attention, written into `out` (made where
    None) and returned (`window` 0: none)."""
    if q.shape[0] != b.num_tokens:
        raise ValueError(f"the forward has {q.shape[0]} tokens; its StepBatch describes {b.num_tokens}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; q is {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}")
    b.write(layer, k, v, store=not b.kernel.stores_kv)
    b.kernel.run(b, layer, q, k, v, scaling, window or None, out)
    return out


@attend_step.register_fake
def _(query, key, value, layer, scaling, window):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
