"""Attention over the KV cache, for the engine's forward passes.

One forward holds several requests back to back (`input_ids [1, T]`): first
one decode token for each of `decode_slots`, then prefill chunks.  Every
layer writes its new K/V into the cache at each request's own positions and
attends over that request's live tokens only.  Decode tokens take one batched
SDPA call over the slot range holding them (rows past a slot's length, and
slots not decoding, are masked; they read the zero page or finite stale
values, never unmapped memory) unless the range is mostly other slots, then
one call per request; each prefill chunk takes one call with a causal mask
aligned to its position.  Grouped KV heads are packed into the query axis
(`[H_kv, G·T, D]` against `[H_kv, L, D]`).  K and V come from the cache's
`rows_kv`: views of the virtual cache, read in place, or rows the paged cache
gathers through its block tables.

`register()` makes the function available to transformers as
`attn_implementation="vattn"`; it expects `vattn_batch=StepBatch` among the
model's keyword arguments, which transformers passes through to attention.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vattn.slot_cache import SlotCache

NAME = "vattn"


@dataclass(slots=True)
class StepBatch:
    cache: SlotCache
    decode_slots: list[int]
    decode_positions: list[int]  # where each decode token goes
    chunks: list[tuple[int, int, int]]  # (slot, first position, tokens) of each prefill chunk
    _masks: dict = field(default_factory=dict)  # decode mask per sliding window, built once per step
    _rows: torch.Tensor | None = None  # decode slots - lo, built once per step

    @property
    def num_tokens(self) -> int:
        return len(self.decode_slots) + sum(n for _, _, n in self.chunks)

    def positions(self) -> list[int]:
        return self.decode_positions + [p for _, start, n in self.chunks for p in range(start, start + n)]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store this forward's `[T, H_kv, D]` K/V of `layer` at each request's positions."""
        d = len(self.decode_slots)
        if d:
            self.cache.write(layer, self.decode_slots, self.decode_positions, key[:d, None], value[:d, None])
        for slot, start, n in self.chunks:
            self.cache.write(layer, [slot], [start], key[None, d:d + n], value[None, d:d + n])
            d += n

    def decode_rows(self) -> tuple[int, int]:
        """The slot range a batched decode call covers."""
        return min(self.decode_slots), max(self.decode_slots) + 1

    def decode_row_index(self) -> torch.Tensor:
        """Where each decode token's slot sits in that range."""
        if self._rows is None:
            self._rows = torch.tensor(self.decode_slots) - self.decode_rows()[0]
        return self._rows

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """`[R, 1, 1, L]`: row r attends to the live tokens of slot lo + r (if decoding)."""
        if window not in self._masks:
            lo, hi = self.decode_rows()
            L = max(self.decode_positions) + 1
            pos = torch.zeros(hi - lo, dtype=torch.long)  # a slot not decoding sees its token 0 (no NaN)
            pos[self.decode_row_index()] = torch.tensor(self.decode_positions)
            kv = torch.arange(L)
            mask = kv <= pos[:, None]
            if window is not None:
                mask &= kv > pos[:, None] - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              vattn_batch: StepBatch | None = None, **kwargs):
    """transformers' attention-interface signature: `query [1, H, T, D]`,
    `key`/`value [1, H_kv, T, D]`; returns `([1, T, H, D], None)`."""
    if vattn_batch is None:
        raise RuntimeError('attn_implementation="vattn" runs inside vattn.LLMEngine steps only')
    b, layer = vattn_batch, module.layer_idx
    _, H, T, D = query.shape
    if T != b.num_tokens:
        raise ValueError(f"the forward has {T} tokens; its StepBatch describes {b.num_tokens}")
    b.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)  # [T, H, D]
    out = torch.empty_like(q)
    d = len(b.decode_slots)
    if d:
        out[:d] = decode(b, layer, q[:d], scaling, sliding_window)
    for slot, start, n in b.chunks:
        k, v = b.cache.rows_kv(layer, slot, slot + 1, start + n)
        out[d:d + n] = prefill(q[d:d + n], k[0], v[0], start, scaling, sliding_window)
        d += n
    return out.unsqueeze(0), None


def decode(b: StepBatch, layer: int, q, scaling, window) -> torch.Tensor:
    """`q [d, H, D]`, one token per decoding slot; returns `[d, H, D]`."""
    d, H, D = q.shape
    Hkv = b.cache.config.num_kv_heads
    lo, hi = b.decode_rows()
    if hi - lo > 2 * d:  # sparse: one call per request
        out = []
        for i, (slot, pos) in enumerate(zip(b.decode_slots, b.decode_positions)):
            first = 0 if window is None else max(0, pos + 1 - window)
            k, v = (t[0, first:].transpose(0, 1) for t in b.cache.rows_kv(layer, slot, slot + 1, pos + 1))
            out.append(_sdpa(q[i].view(Hkv, H // Hkv, D), k, v, None, scaling))
        return torch.stack(out).view(d, H, D)
    K, V = b.cache.rows_kv(layer, lo, hi, max(b.decode_positions) + 1)
    rows = b.decode_row_index()
    packed = q.new_zeros(hi - lo, Hkv, H // Hkv, D)
    packed[rows] = q.view(d, Hkv, H // Hkv, D)
    out = F.scaled_dot_product_attention(packed, K.transpose(1, 2), V.transpose(1, 2),
                                         attn_mask=b.decode_mask(window), scale=scaling)
    return out[rows].view(d, H, D)


def prefill(q, k, v, start: int, scaling, window) -> torch.Tensor:
    """`q [n, H, D]` at positions start.. against `k`/`v [start + n, H_kv, D]`."""
    n, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    packed = q.view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)  # query g·n + i is token i
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(start + n)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    out = _sdpa(packed, k.transpose(0, 1), v.transpose(0, 1), mask.repeat(G, 1), scaling)
    return out.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D)


def _sdpa(q, k, v, mask, scaling) -> torch.Tensor:
    """SDPA on one request's `[H_kv, rows, D]`: given a batch axis, as torch's
    fused CPU kernels require (3-D inputs take a path several times slower)."""
    mask = None if mask is None else mask[None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scaling)[0]


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
