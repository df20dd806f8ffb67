"""Attention over the KV cache, for the engine's forward passes.

One forward holds several requests back to back (`StepBatch`).  Every layer
writes its new K/V into the cache at each request's own positions and attends
over that request's live tokens only, through the cache's data plane
(`vattn.kv.data`), with the kernel the engine picked (`registry.pick`, by the
device, dtype, cache kind and head dim, or by name): vattn's own CPU kernel
(`native`) for a float32 or bfloat16 virtual cache on the host,
FlashAttention (`flash`) on CUDA with flash-attn installed and a 16-bit
virtual cache, else torch SDPA (`sdpa`).

`prepare(batch, data, kernel)` readies a forward once (the kernel's per-step
state); `attend(step, layer, ...)` then serves each layer, the step's writes
checked at the first for every layer.  `register()` makes `attention` available to
transformers as `attn_implementation="vattn"`: it attends for the step of the
forward running inside `running(step)`, through one torch operator,
`vattn::attention`, so that `torch.compile` traces a model around it without
breaking its graph.
"""
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vattn.attention.batch import StepBatch
from vattn.attention.registry import Kernel
from vattn.kv.data import CheckedWrite, KVData

NAME = "vattn"


@dataclass(slots=True)
class AttentionStep:
    """One forward's attention: what it holds, the cache it reads and writes, and the kernel's calls."""

    batch: StepBatch
    data: KVData
    kernel: Kernel
    calls: object  # the kernel's (`Kernel.prepare`)
    _writes: list[CheckedWrite] | None = None

    def writes(self) -> list[CheckedWrite]:
        """The forward's writes (its decode tokens', then each prefill
        chunk's), checked once for every layer, since each writes the same
        positions: a ValueError where one may not go where it would."""
        if self._writes is None:
            b, data = self.batch, self.data
            self._writes = ([data.check(b.decode_slots, b.decode_positions, 1)] if b.decode_slots else []) + [
                data.check([slot], [start], n) for slot, start, n in b.chunks]
        return self._writes


def prepare(batch: StepBatch, data: KVData, kernel: Kernel) -> AttentionStep:
    """`batch`'s attention over `data`, by `kernel`."""
    return AttentionStep(batch, data, kernel, kernel.prepare(batch, data))


def attend(step: AttentionStep, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           window: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer` of the forward: its K/V `[T, H_kv, D]` into the cache,
    and `q [T, H, D]`'s attention, written into `out` (made where None) and
    returned (`window` 0: none)."""
    b = step.batch
    if q.shape[0] != b.num_tokens:
        raise ValueError(f"the forward has {q.shape[0]} tokens; its StepBatch describes {b.num_tokens}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is {out.dtype} {tuple(out.shape)} on {out.device}; q is {q.dtype} "
                         f"{tuple(q.shape)} on {q.device}")
    d, writes = len(b.decode_slots), step.writes()
    if not step.kernel.stores_kv:
        parts = ([(slice(0, d), 1)] if d else []) + [(rows, 0) for _, _, rows in b.prefill_chunks()]
        for write, (rows, axis) in zip(writes, parts):
            step.data.store(layer, write, k[rows].unsqueeze(axis), v[rows].unsqueeze(axis))
    step.calls.run(layer, q, k, v, scaling, window or None, out)
    if step.kernel.stores_kv:
        for write in writes:
            step.data.record(write, range(layer, layer + 1))
    return out


_steps = threading.local()  # the AttentionStep of the forward each thread runs


@contextmanager
def running(step: AttentionStep):
    """Attention inside this block serves `step`."""
    outer, _steps.step = getattr(_steps, "step", None), step
    try:
        yield
    finally:
        _steps.step = outer


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """transformers' attention-interface signature: `query [1, H, T, D]`,
    `key`/`value [1, H_kv, T, D]`; returns `([1, T, H, D], None)`."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return attend_step(query, key, value, module.layer_idx, scaling, sliding_window or 0), None


@torch.library.custom_op("vattn::attention", mutates_args=())
def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                window: int) -> torch.Tensor:
    """Write layer `layer`'s K/V of the step into the cache, and attend (`window` 0: none)."""
    step = getattr(_steps, "step", None)
    if step is None:
        raise RuntimeError('attn_implementation="vattn" runs inside vattn.LLMEngine steps only')
    return attend(step, layer, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scaling,
                  window).unsqueeze(0)


@attend_step.register_fake
def _(query, key, value, layer, scaling, window):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
