"""vattn's own CPU attention (`vattn.binding.attend`) over the virtual cache's
strided views, read in place: one call a layer for the whole forward, every
decode token and prefill chunk a request reading its slot's rows up to its
own length (bottom-right causal) and no further, so it never touches an
unmapped row.  In the engine the same call first stores the forward's new
K/V at each request's rows (the cache has checked them).  Grouped K/V heads
are read once for all their query heads; float32 and bfloat16, summed in
float32; torch's thread count.
"""
import vattn.binding as binding
from vattn.attention.batch import StepBatch
from vattn.kv.data import KVData

MAX_HEAD_DIM = 256


def serves_head_dim(head_dim: int) -> bool:
    return head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


class NativeStep:
    """A forward's calls: one request table, every layer's."""

    def __init__(self, batch: StepBatch, data: KVData):
        self.data = data
        decodes = enumerate(zip(batch.decode_slots, batch.decode_positions))
        self.table = binding.request_table(
            [(slot, 0, pos + 1, i, 1) for i, (slot, pos) in decodes]
            + [(slot, 0, start + rows.stop - rows.start, rows.start, rows.stop - rows.start)
               for slot, start, rows in batch.prefill_chunks()])

    def run(self, layer: int, q, k, v, scaling, window, out) -> None:
        """`q`, `out [T, H, D]`, `k`/`v [T, H_kv, D]` of the whole forward: stores
        k/v in the cache, and attends."""
        K, V = self.data.views(layer)
        binding.attend(q, K, V, self.table, scaling, window, out, k, v)
