"""Attention over the KV cache, for the engine's forward passes.

One forward holds several requests back to back (`input_ids [1, T]`): first
one decode token for each of `decode_slots`, then prefill chunks.  Every
layer writes its new K/V into the cache at each request's own positions and
attends over that request's live tokens only.

On CUDA with flash-attn installed and a 16-bit virtual cache,
`flash_attn_with_kvcache` reads the cache views in place: all decode tokens
in one call (`cache_seqlens` = their positions, `cache_batch_idx` = their
slots), each prefill chunk in another, the new K/V appended by the kernel.
It reads no row past `cache_seqlens` + the new tokens, so nothing unmapped.

Otherwise torch SDPA: decode tokens take one batched call over the slot range
holding them (rows past a slot's length, and slots not decoding, are masked)
when every row of that range is readable (the host's zero page backs what is
not mapped; on CUDA each slot must map the whole length) and the range is
mostly decoding slots, else one call per request over its live rows; each
prefill chunk takes one call with a causal mask aligned to its position.
Grouped KV heads are packed into the query axis (`[H_kv, G·T, D]` against
`[H_kv, L, D]`).  K and V come from the cache's `rows_kv`: views of the
virtual cache, read in place, or rows the paged cache gathers through its
block tables.

`register()` makes the function available to transformers as
`attn_implementation="vattn"`; it expects `vattn_batch=StepBatch` among the
model's keyword arguments, which transformers passes through to attention.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vattn.kv.slots import SlotCache

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # optional: CUDA only
    flash_attn_with_kvcache = None

NAME = "vattn"


@dataclass(slots=True)
class StepBatch:
    cache: SlotCache
    decode_slots: list[int]
    decode_positions: list[int]  # where each decode token goes
    chunks: list[tuple[int, int, int]]  # (slot, first position, tokens) of each prefill chunk
    _masks: dict = field(default_factory=dict)  # decode masks and kernel arguments, built once per step
    _rows: torch.Tensor | None = None  # decode slots - lo, built once per step

    @property
    def num_tokens(self) -> int:
        return len(self.decode_slots) + sum(n for _, _, n in self.chunks)

    def positions(self) -> list[int]:
        return self.decode_positions + [p for _, start, n in self.chunks for p in range(start, start + n)]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, store: bool = True) -> None:
        """Store this forward's `[T, H_kv, D]` K/V of `layer` at each request's
        positions (with `store=False` only check and record it: the kernel
        appends it)."""
        d = len(self.decode_slots)
        if d:
            self.cache.write(layer, self.decode_slots, self.decode_positions, key[:d, None], value[:d, None], store)
        for slot, start, n in self.chunks:
            self.cache.write(layer, [slot], [start], key[None, d:d + n], value[None, d:d + n], store)
            d += n

    def decode_rows(self) -> tuple[int, int]:
        """The slot range a batched decode call covers."""
        return min(self.decode_slots), max(self.decode_slots) + 1

    def decode_row_index(self) -> torch.Tensor:
        """Where each decode token's slot sits in that range."""
        if self._rows is None:
            self._rows = torch.tensor(self.decode_slots, device=self.cache.device) - self.decode_rows()[0]
        return self._rows

    def tensor(self, name: str, values: list[int]) -> torch.Tensor:
        """`values` as int32 on the cache's device, made once a step."""
        if name not in self._masks:
            self._masks[name] = torch.tensor(values, dtype=torch.int32, device=self.cache.device)
        return self._masks[name]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """`[R, 1, 1, L]`: row r attends to the live tokens of slot lo + r (if decoding)."""
        if window not in self._masks:
            lo, hi = self.decode_rows()
            L = max(self.decode_positions) + 1
            device = self.cache.device
            pos = torch.zeros(hi - lo, dtype=torch.long, device=device)  # a slot not decoding sees its token 0
            pos[self.decode_row_index()] = torch.tensor(self.decode_positions, device=device)
            kv = torch.arange(L, device=device)
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
    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if _flash_reads(b.cache, q):
        b.write(layer, k, v, store=False)
        return flash(b, layer, q, k, v, scaling, sliding_window).unsqueeze(0), None
    b.write(layer, k, v)
    out = torch.empty_like(q)
    d = len(b.decode_slots)
    if d:
        out[:d] = decode(b, layer, q[:d], scaling, sliding_window)
    for slot, start, n in b.chunks:
        k, v = b.cache.rows_kv(layer, slot, slot + 1, start + n)
        out[d:d + n] = prefill(q[d:d + n], k[0], v[0], start, scaling, sliding_window)
        d += n
    return out.unsqueeze(0), None


def _flash_reads(cache: SlotCache, q: torch.Tensor) -> bool:
    return (flash_attn_with_kvcache is not None and q.is_cuda and hasattr(cache, "layer_kv")
            and cache.config.dtype in (torch.float16, torch.bfloat16))


def flash(b: StepBatch, layer: int, q, k, v, scaling, window) -> torch.Tensor:
    """`flash_attn_with_kvcache` over the virtual cache's views: `q`, `k`, `v`
    `[T, H(_kv), D]`; the kernel appends `k`/`v` at each request's position.
    Returns `[T, H, D]`."""
    K, V = b.cache.layer_kv(layer)
    args = dict(softmax_scale=scaling, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0))
    out = torch.empty_like(q)
    d = len(b.decode_slots)
    if d:
        out[:d] = flash_attn_with_kvcache(
            q[:d, None], K, V, k[:d, None], v[:d, None], cache_seqlens=b.tensor("seqlens", b.decode_positions),
            cache_batch_idx=b.tensor("slots", b.decode_slots), **args)[:, 0]
    for slot, start, n in b.chunks:
        out[d:d + n] = flash_attn_with_kvcache(
            q[None, d:d + n], K, V, k[None, d:d + n], v[None, d:d + n], cache_seqlens=b.tensor(f"start{slot}", [start]),
            cache_batch_idx=b.tensor(f"slot{slot}", [slot]), **args)[0]
        d += n
    return out


def decode(b: StepBatch, layer: int, q, scaling, window) -> torch.Tensor:
    """`q [d, H, D]`, one token per decoding slot; returns `[d, H, D]`."""
    d, H, D = q.shape
    Hkv = b.cache.config.num_kv_heads
    lo, hi = b.decode_rows()
    L = max(b.decode_positions) + 1
    if hi - lo > 2 * d or not b.cache.readable(lo, hi, L):  # one call per request
        out = []
        for i, (slot, pos) in enumerate(zip(b.decode_slots, b.decode_positions)):
            first = 0 if window is None else max(0, pos + 1 - window)
            k, v = (t[0, first:].transpose(0, 1) for t in b.cache.rows_kv(layer, slot, slot + 1, pos + 1))
            out.append(_sdpa(q[i].view(Hkv, H // Hkv, D), k, v, None, scaling))
        return torch.stack(out).view(d, H, D)
    K, V = b.cache.rows_kv(layer, lo, hi, L)
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
    qpos = torch.arange(start, start + n, device=q.device)[:, None]
    kpos = torch.arange(start + n, device=q.device)
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
