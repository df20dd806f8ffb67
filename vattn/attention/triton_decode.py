"""A Triton decode kernel over the virtual cache's strided views, read in
place: every decode token of the forward in one launch, each reading its own
slot's rows up to its own length and no further (masked loads touch no other
address), so unlike one batched SDPA call over a slot range it needs no row
past a slot's pages mapped.  One program per (token, KV head) holds all the
head's grouped query heads and runs an online softmax over blocks of rows,
in float32 (16-bit K/V are exact in TF32, so their dots may use it).
Prefill chunks go to SDPA, one call a chunk over the slot's own rows.

With `TRITON_INTERPRET=1` set before triton is imported, the kernel runs on
host tensors in Triton's interpreter (how the host tests check it).
"""
import functools

import torch

from vattn.attention.batch import StepBatch
from vattn.attention.sdpa import SdpaStep
from vattn.kv.data import KVData

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: CUDA only
    triton = None

AVAILABLE = triton is not None
MAX_HEAD_DIM = 256
BLOCK_ROWS = 64  # cache rows a program reads per softmax block


def serves_head_dim(head_dim: int) -> bool:
    return 0 < head_dim <= MAX_HEAD_DIM


class TritonStep:
    """A forward's launches: the decode tokens' slots and lengths made once, every layer's."""

    def __init__(self, batch: StepBatch, data: KVData):
        self.data, self.prefills = data, SdpaStep(batch, data)
        self.d = len(batch.decode_slots)
        ints = functools.partial(torch.tensor, dtype=torch.int32, device=data.device)
        self.slots = ints(batch.decode_slots)
        self.lengths = ints([p + 1 for p in batch.decode_positions])

    def run(self, layer: int, q, k, v, scaling, window, out) -> None:
        """`q`, `out [T, H, D]` of the whole forward; `k`/`v` are already in the cache."""
        d = self.d
        if d:
            K, V = self.data.views(layer)
            decode(q[:d], K, V, self.slots, self.lengths, scaling, window, out[:d],
                   checked=True)  # the cache checked the slots and positions it wrote
        self.prefills.prefill_into(out, layer, q, scaling, window)


def decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           scale: float, window: int | None = None, out: torch.Tensor | None = None,
           checked: bool = False) -> torch.Tensor:
    """`q`, `out [d, H, D]`: token i attends to rows [max(0, lengths[i] - window),
    lengths[i]) of slot `slots[i]` of `K`, `V [slots, rows, H_kv, D]` (any
    strides, the last dimension contiguous).  A ValueError for inputs the
    kernel cannot take, before anything runs; `checked`: the caller vouches
    for the slots and lengths (checking them waits for the device)."""
    if triton is None:
        raise RuntimeError("the Triton decode kernel needs triton (pip install 'vattn[cuda]')")
    d, H, D = q.shape
    Hkv = K.shape[2]
    out = torch.empty_like(q) if out is None else out
    if K.shape != V.shape or K.dim() != 4 or K.shape[3] != D or H % Hkv:
        raise ValueError(f"q {list(q.shape)} and K {list(K.shape)} / V {list(V.shape)} do not fit: "
                         f"K and V must be [slots, rows, H_kv, {D}] with H_kv dividing {H}")
    if out.shape != q.shape or slots.shape != (d,) or lengths.shape != (d,):
        raise ValueError(f"out {list(out.shape)}, slots {list(slots.shape)} and lengths {list(lengths.shape)} "
                         f"must be {list(q.shape)}, [{d}], [{d}]")
    if any(t.stride(-1) != 1 for t in (q, K, V, out)):
        raise ValueError("q, K, V and out need a contiguous last dimension")
    if any(t.device != q.device for t in (K, V, out, slots, lengths)):
        raise ValueError(f"q, K, V, out, slots and lengths must all be on {q.device}")
    if not d:
        return out
    if not checked:
        low_slot, high_slot, shortest, longest = torch.stack(
            [slots.min(), slots.max(), lengths.min(), lengths.max()]).tolist()
        if low_slot < 0 or high_slot >= K.shape[0] or shortest < 1 or longest > K.shape[1]:
            raise ValueError(f"slots must be in [0, {K.shape[0]}) and lengths in [1, {K.shape[1]}]; got slots "
                             f"{low_slot}..{high_slot}, lengths {shortest}..{longest}")
    G = H // Hkv
    _kernel()[(d, Hkv)](
        q, K, V, out, slots, lengths, float(scale), int(window or 0),
        q.stride(0), q.stride(1), K.stride(0), K.stride(1), K.stride(2), V.stride(0), V.stride(1), V.stride(2),
        out.stride(0), out.stride(1),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_N=BLOCK_ROWS, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out


@functools.cache  # made at first use: importing vattn builds no kernel
def _kernel():
    @triton.jit
    def decode_kernel(Q, K, V, Out, Slots, Lengths, scale, window,
                      sq_t, sq_h, sk_s, sk_t, sk_h, sv_s, sv_t, sv_h, so_t, so_h,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)  # the decode token
        h = tl.program_id(1).to(tl.int64)  # its KV head
        slot = tl.load(Slots + i).to(tl.int64)
        length = tl.load(Lengths + i)
        first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        q_mask = (g[:, None] < G) & (d[None, :] < D)
        heads = h * G + g
        q = tl.load(Q + i * sq_t + heads[:, None] * sq_h + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_base = K + slot * sk_s + h * sk_h
        v_base = V + slot * sv_s + h * sv_h
        for start in range(first // BLOCK_N * BLOCK_N, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            live = (n >= first) & (n < length)
            rows = n.to(tl.int64)[:, None]
            kv_mask = live[:, None] & (d[None, :] < D)
            k = tl.load(k_base + rows * sk_t + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            rescale = tl.exp(m - m_new)
            total = total * rescale + tl.sum(p, 1)
            v = tl.load(v_base + rows * sv_t + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        o = acc / total[:, None]
        tl.store(Out + i * so_t + heads[:, None] * so_h + d[None, :], o.to(Out.dtype.element_ty), mask=q_mask)

    return decode_kernel
