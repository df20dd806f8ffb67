"""FlashAttention's `flash_attn_with_kvcache` over the cache, read in place:
all decode tokens in one call (`cache_seqlens` = their positions), each
prefill chunk in another, the new K/V appended by the kernel.  A virtual
cache hands it whole-buffer views (`cache_batch_idx` = the slots); a paged
cache its block pools and tables (`block_table`, blocks a multiple of 256
tokens, as flash-attn requires).  It reads no row past `cache_seqlens` + the
new tokens, so nothing unmapped.
"""
import torch

from vattn.attention.batch import StepBatch
from vattn.kv.data import KVData

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


class FlashStep:
    """A forward's calls, with the index tensors they share across layers."""

    def __init__(self, batch: StepBatch, data: KVData):
        self.batch, self.data = batch, data
        device = data.device
        where = (lambda slots: {"block_table": _ints(data.block_tables(slots), device)}) if data.kind == "paged" \
            else (lambda slots: {"cache_batch_idx": _ints(slots, device)})
        self._decode = (where(batch.decode_slots), _ints(batch.decode_positions, device)) if batch.decode_slots \
            else None
        self._chunks = [(where([slot]), _ints([start], device)) for slot, start, _ in batch.chunks]

    def run(self, layer: int, q, k, v, scaling, window, out) -> None:
        """`q`, `out [T, H, D]`, `k`, `v [T, H_kv, D]` of the whole forward; the
        kernel appends `k`/`v` at each request's position."""
        K, V = self.data.views(layer)
        d = len(self.batch.decode_slots)
        if d:
            where, positions = self._decode
            out[:d] = _append_and_attend(K, V, q[:d, None], k[:d, None], v[:d, None], where, positions, scaling,
                                         window)[:, 0]
        for (_, _, rows), (where, start) in zip(self.batch.prefill_chunks(), self._chunks):
            out[rows] = _append_and_attend(K, V, q[None, rows], k[None, rows], v[None, rows], where, start, scaling,
                                           window)[0]


def _ints(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _append_and_attend(K, V, q, k, v, where, positions, scaling, window) -> torch.Tensor:
    """One call: `q`, `k`, `v [rows, n, H(_kv), D]`; row i appends its `k`/`v`
    to its slot (`where`) at `positions[i]` and attends causally up to them."""
    return flash_attn_with_kvcache(q, K, V, k, v, cache_seqlens=positions, softmax_scale=scaling, causal=True,
                                   window_size=(-1, -1) if window is None else (window - 1, 0), **where)
