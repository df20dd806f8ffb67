"""FlashAttention's `flash_attn_with_kvcache` over the virtual cache's views,
read in place: all decode tokens in one call (`cache_seqlens` = their
positions, `cache_batch_idx` = their slots), each prefill chunk in another,
the new K/V appended by the kernel.  It reads no row past `cache_seqlens` +
the new tokens, so nothing unmapped.
"""
import torch

from vattn.attention.metadata import StepBatch

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # optional: CUDA only
    flash_attn_with_kvcache = None

AVAILABLE = flash_attn_with_kvcache is not None
MAX_HEAD_DIM = 256


def serves_head_dim(head_dim: int) -> bool:
    """flash-attn pads any other head dim up to a multiple of 8 by copying the
    whole cache view it is given, which reads the reservation's unmapped pages
    (an illegal address), and has no kernels past 256."""
    return head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def run(b: StepBatch, layer: int, q, k, v, scaling, window) -> torch.Tensor:
    """`q`, `k`, `v [T, H(_kv), D]` of the whole forward; the kernel appends
    `k`/`v` at each request's position.  Returns `[T, H, D]`."""
    K, V = b.cache.layer_kv(layer)
    out = torch.empty_like(q)
    d = len(b.decode_slots)
    if d:
        out[:d] = _append_and_attend(K, V, q[:d, None], k[:d, None], v[:d, None], b.tensor("slots", b.decode_slots),
                                     b.tensor("seqlens", b.decode_positions), scaling, window)[:, 0]
    for slot, start, rows in b.prefill_chunks():
        out[rows] = _append_and_attend(K, V, q[None, rows], k[None, rows], v[None, rows],
                                       b.tensor(f"slot{slot}", [slot]), b.tensor(f"start{slot}", [start]),
                                       scaling, window)[0]
    return out


def _append_and_attend(K, V, q, k, v, slots, positions, scaling, window) -> torch.Tensor:
    """One call: `q`, `k`, `v [rows, n, H(_kv), D]`; row i appends its `k`/`v`
    to cache slot `slots[i]` at `positions[i]` and attends causally up to them."""
    return flash_attn_with_kvcache(q, K, V, k, v, cache_seqlens=positions, cache_batch_idx=slots,
                                   softmax_scale=scaling, causal=True,
                                   window_size=(-1, -1) if window is None else (window - 1, 0))
