"""FlashAttention's `flash_attn_with_kvcache` over the cache, read in place:
all decode tokens in one call (`cache_seqlens` = their positions), each
prefill chunk in another, the new K/V appended by the kernel.  A virtual
cache hands it whole-buffer views (`cache_batch_idx` = the slots); a paged
cache its block pools and tables (`block_table`, blocks a multiple of 256
tokens, as flash-attn requires).  It reads no row past `cache_seqlens` + the
new tokens, so nothing unmapped.
"""
import torch

from vattn.attention.metadata import StepBatch

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # optional: CUDA only
    flash_attn_with_kvcache = None

AVAILABLE = flash_attn_with_kvcache is not None
MAX_HEAD_DIM = 256
BLOCK_MULTIPLE = 256  # flash-attn's paged KV blocks are multiples of this many tokens


def serves_block_size(block_size: int) -> bool:
    return block_size % BLOCK_MULTIPLE == 0


def serves_head_dim(head_dim: int) -> bool:
    """flash-attn pads any other head dim up to a multiple of 8 by copying the
    whole cache view it is given, which reads the reservation's unmapped pages
    (an illegal address), and has no kernels past 256."""
    return head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def run(b: StepBatch, layer: int, q, k, v, scaling, window, out) -> None:
    """`q`, `out [T, H, D]`, `k`, `v [T, H_kv, D]` of the whole forward; the
    kernel appends `k`/`v` at each request's position."""
    paged = b.cache.kind == "paged"
    K, V = b.cache.layer_blocks(layer) if paged else b.cache.layer_kv(layer)
    d = len(b.decode_slots)
    if d:
        out[:d] = _append_and_attend(K, V, q[:d, None], k[:d, None], v[:d, None], _where(b, "decode", b.decode_slots),
                                     b.tensor("seqlens", b.decode_positions), scaling, window)[:, 0]
    for slot, start, rows in b.prefill_chunks():
        out[rows] = _append_and_attend(K, V, q[None, rows], k[None, rows], v[None, rows],
                                       _where(b, f"slot{slot}", [slot]), b.tensor(f"start{slot}", [start]),
                                       scaling, window)[0]


def _where(b: StepBatch, name: str, slots: list[int]) -> dict[str, torch.Tensor]:
    """How the kernel finds the slots' K/V: their block tables in a paged
    cache, their batch rows in the virtual cache's views; made once a step."""
    if b.cache.kind == "paged":
        return {"block_table": b.tensor(f"tables {name}", lambda: b.cache.block_tables(slots))}
    return {"cache_batch_idx": b.tensor(name, slots)}


def _append_and_attend(K, V, q, k, v, where, positions, scaling, window) -> torch.Tensor:
    """One call: `q`, `k`, `v [rows, n, H(_kv), D]`; row i appends its `k`/`v`
    to its slot (`where`) at `positions[i]` and attends causally up to them."""
    return flash_attn_with_kvcache(q, K, V, k, v, cache_seqlens=positions, softmax_scale=scaling, causal=True,
                                   window_size=(-1, -1) if window is None else (window - 1, 0), **where)
