"""The paged baseline: a block pool and per-request block tables, as in vLLM.

Each layer's K and V live in a pool of blocks of `block_size` tokens
(`[num_blocks, block_size, H, D]`).  A slot's pages (`vattn.kv.slots`) are
its block table, so allocation, sharing by reference counts, deferred
reclamation, swap and the whole cache interface the engine uses are the
virtual cache's; only where the tokens lie differs.  A kernel that wants a
slot's tokens as one tensor must gather them through the block table:
`KVData.rows` copies them into a reused buffer, where the virtual cache hands out
views.

The pool is one range of the VMM backend, mapped whole when the cache is made
(one call), so physical memory is committed only where blocks are written and
a production-size pool fits a replay that writes nothing.
"""
import dataclasses

import torch

from vattn.backends import Backend, get_backend
from vattn.config import CacheConfig, resolve
from vattn.kv.slots import SlotCache

_CHUNK = 2 << 20  # the pool is mapped in pieces of this size
_WRITES_KEPT = 64  # write indices kept: a step's writes (its decode tokens, each prefill chunk) and more


class PagedStorage:
    """Blocks in a pool reached through block tables; one block more, never
    written, is what rows past a table read."""

    zero_backed = True

    def __init__(self, config: CacheConfig, block_size: int, backend: Backend):
        c = self.config = config
        self.block_size, self.backend, self.device = block_size, backend, backend.device
        self.zero_block = c.num_pages  # rows past a table read this block, never written
        blocks = c.num_pages + 1
        chunk = -(-_CHUNK // backend.granularity) * backend.granularity
        chunks = -(-c.num_buffers * blocks * c.page_size // chunk)
        self._memory = backend.create_pool(chunks, chunk)
        self._reservation = backend.reserve(chunks * chunk)
        backend.map(self._reservation, self._memory, [i * chunk for i in range(chunks)], list(range(chunks)))
        self._bytes = backend.tensor(self._reservation, torch.uint8, (c.num_buffers, blocks, c.page_size),
                                     (blocks * c.page_size, c.page_size, 1))
        H, D, size = c.num_kv_heads, c.head_dim, c.dtype.itemsize
        self.pools = [backend.tensor(self._reservation, c.dtype, (blocks * block_size, H, D), (H * D, D, 1),
                                      b * blocks * c.page_size // size) for b in range(c.num_buffers)]
        self._gathered = [torch.empty(0, H, D, dtype=c.dtype, device=self.device) for _ in range(2)]
        # gather rows per (lo, hi, length), built once a step for every layer and dropped when a table
        # changes; the mapping worker only appends past a slot's length or takes idle and surplus
        # blocks, which rows past the lengths may read stale anyway (masked, finite)
        self._index: dict[tuple[int, int, int], torch.Tensor] = {}
        self._write_index: dict[tuple, torch.Tensor] = {}  # pool rows per (slots, positions, T), the same way

    def draw_entries(self, n: int) -> None:
        """Nothing: the pool is mapped once, whole."""

    def map(self, entries, pages) -> None:
        self._forget_indices()  # blocks enter the tables once the caller appends them

    def unmap(self, entries) -> None:
        self._forget_indices()

    def _forget_indices(self) -> None:
        self._index.clear()
        self._write_index.clear()

    def release(self, pages) -> None:
        """Blocks stay committed: the pool is mapped whole."""

    def committed_bytes(self) -> int:
        return self.backend.committed_bytes(self._memory)

    def views(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pools `[num_blocks + 1, block_size, H, D]` (the last block is never written)."""
        k, v = self.pools[2 * layer], self.pools[2 * layer + 1]
        return k.view(-1, self.block_size, *k.shape[1:]), v.view(-1, self.block_size, *v.shape[1:])

    def rows(self, layer, lo, hi, tables, length) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered into one buffer for K and one for V, reused by the next call."""
        index = self._index.get((lo, hi, length))
        if index is None:
            index = self._index[lo, hi, length] = self._token_rows(tables, length)
        out = []
        for i, pool in enumerate((self.pools[2 * layer], self.pools[2 * layer + 1])):
            if self._gathered[i].shape[0] < index.numel():
                self._gathered[i] = pool.new_empty(index.numel(), *pool.shape[1:])
            buffer = self._gathered[i][:index.numel()]
            torch.index_select(pool, 0, index, out=buffer)
            out.append(buffer.view(hi - lo, length, *pool.shape[1:]))
        return out[0], out[1]

    def tables(self, tables: list[list[int]]) -> list[list[int]]:
        """`tables` as rows of one length, each padded with the block that is never written."""
        width = max(map(len, tables), default=0)
        return [t + [self.zero_block] * (width - len(t)) for t in tables]

    def _token_rows(self, tables, length: int) -> torch.Tensor:
        """Pool rows of tokens 0..length-1 of each table, table-major; past a
        table's blocks, the zero block."""
        bs = self.block_size
        table = torch.full((len(tables), -(-length // bs)), self.zero_block, dtype=torch.long)
        for r, blocks in enumerate(tables):
            blocks = blocks[:table.shape[1]]
            table[r, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        rows = table[:, :, None] * bs + torch.arange(bs)
        return rows.view(len(tables), -1)[:, :length].reshape(-1).to(self.device)

    def store(self, layer, slots, tables, positions, key, value) -> None:
        rows = self._write_rows(slots, tables, positions, key.shape[1])
        self.pools[2 * layer].index_copy_(0, rows, key.reshape(-1, *key.shape[2:]))
        self.pools[2 * layer + 1].index_copy_(0, rows, value.reshape(-1, *value.shape[2:]))

    def _write_rows(self, slots, tables, positions, T: int) -> torch.Tensor:
        """Pool rows of the tokens a write puts at `positions` of the slots:
        made once for every layer of a step (on CUDA each is a copy to the
        device, which the host waits for)."""
        key = (tuple(slots), tuple(positions), T)
        rows = self._write_index.get(key)
        if rows is None:
            if len(self._write_index) >= _WRITES_KEPT:  # earlier steps' (no table changed since)
                self._write_index.clear()
            bs = self.block_size
            rows = self._write_index[key] = torch.tensor(
                [blocks[p // bs] * bs + p % bs for blocks, pos in zip(tables, positions) for p in range(pos, pos + T)],
                device=self.device)
        return rows

    def _blocks_holding(self, table: list[int], start: int, nbytes: int) -> tuple[torch.Tensor, int]:
        """The blocks that hold bytes start..start+nbytes, and where start lies in the first."""
        ps = self.config.page_size
        first = start // ps
        blocks = table[first:-(-(start + nbytes) // ps)]
        return torch.tensor(blocks, dtype=torch.long, device=self.device), start - first * ps

    def read(self, slot, table, start, nbytes) -> torch.Tensor:
        if not nbytes:
            return self._bytes.new_empty(self.config.num_buffers, 0)
        blocks, offset = self._blocks_holding(table, start, nbytes)
        return self._bytes[:, blocks].reshape(self.config.num_buffers, -1)[:, offset:offset + nbytes]

    def write(self, slot, table, start, data) -> None:
        if not data.shape[1]:
            return
        blocks, offset = self._blocks_holding(table, start, data.shape[1])
        held = self._bytes[:, blocks]
        held.view(self.config.num_buffers, -1)[:, offset:offset + data.shape[1]] = data
        self._bytes[:, blocks] = held


class PagedKVCache(SlotCache):
    kind = "paged"  # kernels read block pools through block tables

    def __init__(self, config: CacheConfig, block_size: int = 16, backend: Backend | None = None):
        """The geometry, slots and memory budget of `config`; its layout and
        page size give way to blocks of `block_size` tokens per layer."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        backend = backend or get_backend(config.device)
        token = config.num_kv_heads * config.head_dim * config.dtype.itemsize
        config = resolve(dataclasses.replace(config, layout="per_layer", page_size=block_size * token), backend)
        super().__init__(config, PagedStorage(config, block_size, backend))
        self.block_size, self.backend = block_size, backend
