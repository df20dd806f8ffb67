"""Torch SDPA over K/V the cache already holds, read through `KVData.rows`:
views of the virtual cache, read in place, or rows the paged cache gathers
through its block tables.

Decode tokens take one batched call over the slot range holding them (rows
past a slot's length, and slots not decoding, are masked) when the range is
mostly decoding slots (`range_read`) and every row of it is readable (the
host's zero page backs what is not mapped; on CUDA the engine maps a
read-only zero page there first, `KVData.readable`), else one call
per request over its live rows; each prefill chunk takes one call with a
causal mask aligned to its position.  Grouped KV heads are
packed into the query axis (`[H_kv, G·T, D]` against `[H_kv, L, D]`).
"""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vattn.attention.batch import StepBatch
from vattn.kv.data import KVData

# cuDNN attention, which torch tries first on sm90, plans anew for every new
# shape and stride: a host stall every decode step as the lengths grow
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends(device: torch.device):
    """The SDPA backends the engine's forwards may use on `device` (pinned on CUDA)."""
    return sdpa_kernel(CUDA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


class SdpaStep:
    """A forward's SDPA calls, with the masks and indices they share across layers."""

    def __init__(self, batch: StepBatch, data: KVData):
        self.batch, self.data = batch, data
        self.per_request_decodes = 0  # layers whose decode tokens took one call per request
        self._masks: dict[int | None, torch.Tensor] = {}  # decode mask per window
        self._rows: torch.Tensor | None = None  # decode slots - lo

    def run(self, layer: int, q, k, v, scaling, window, out) -> None:
        """`q`, `out [T, H, D]` of the whole forward; `k`/`v` are already in the cache."""
        d = len(self.batch.decode_slots)
        if d:
            out[:d] = self.decode(layer, q[:d], scaling, window)
        self.prefill_into(out, layer, q, scaling, window)

    def prefill_into(self, out, layer: int, q, scaling, window) -> None:
        """Attend each prefill chunk of `q [T, H, D]` over its slot's own rows, into `out`."""
        for slot, start, rows in self.batch.prefill_chunks():
            chunk = q[rows]
            keys, values = self.data.rows(layer, slot, slot + 1, start + len(chunk))
            out[rows] = prefill(chunk, keys[0], values[0], start, scaling, window)

    def decode(self, layer: int, q, scaling, window) -> torch.Tensor:
        """`q [d, H, D]`, one token per decoding slot; returns `[d, H, D]`."""
        b, d, (_, H, D) = self.batch, q.shape[0], q.shape
        Hkv = self.data.config.num_kv_heads
        reads = range_read(b)
        if reads is None or not self.data.readable(*reads):  # one call per request
            self.per_request_decodes += 1
            out = []
            for i, (slot, pos) in enumerate(zip(b.decode_slots, b.decode_positions)):
                first = 0 if window is None else max(0, pos + 1 - window)
                k, v = (t[0, first:].transpose(0, 1) for t in self.data.rows(layer, slot, slot + 1, pos + 1))
                out.append(_sdpa(q[i].view(Hkv, H // Hkv, D), k, v, None, scaling))
            return torch.stack(out).view(d, H, D)
        lo, hi, L = reads
        K, V = self.data.rows(layer, lo, hi, L)
        rows = self._row_index()
        packed = q.new_zeros(hi - lo, Hkv, H // Hkv, D)
        packed[rows] = q.view(d, Hkv, H // Hkv, D)
        out = F.scaled_dot_product_attention(packed, K.transpose(1, 2), V.transpose(1, 2),
                                             attn_mask=self._mask(window), scale=scaling)
        return out[rows].reshape(d, H, D)  # on CUDA SDPA may give its output strided

    def _row_index(self) -> torch.Tensor:
        """Where each decode token's slot sits in the range `decode_rows`."""
        if self._rows is None:
            b = self.batch
            self._rows = torch.tensor(b.decode_slots, device=self.data.device) - b.decode_rows()[0]
        return self._rows

    def _mask(self, window: int | None) -> torch.Tensor:
        """`[R, 1, 1, L]`: row r attends to the live tokens of slot lo + r (if decoding)."""
        if window not in self._masks:
            b, device = self.batch, self.data.device
            lo, hi = b.decode_rows()
            L = max(b.decode_positions) + 1
            pos = torch.zeros(hi - lo, dtype=torch.long, device=device)  # a slot not decoding sees its token 0
            pos[self._row_index()] = torch.tensor(b.decode_positions, device=device)
            kv = torch.arange(L, device=device)
            mask = kv <= pos[:, None]
            if window is not None:
                mask &= kv > pos[:, None] - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]


def range_read(b: StepBatch) -> tuple[int, int, int] | None:
    """(lo, hi, length): the rows of slots lo..hi-1 the batched decode call
    reads whole, or None where decode goes request by request."""
    d = len(b.decode_slots)
    if not d:
        return None
    lo, hi = b.decode_rows()
    return (lo, hi, max(b.decode_positions) + 1) if hi - lo <= 2 * d else None


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
