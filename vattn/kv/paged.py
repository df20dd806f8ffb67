"""The paged baseline: a block pool and per-request block tables, as in vLLM.

Each layer's K and V live in a pool of blocks of `block_size` tokens
(`[num_blocks, block_size, H, D]`).  A slot's page groups (`vattn.kv.slots`)
are its block table, so allocation, sharing by reference counts, deferred
reclamation, swap and the whole cache interface the engine uses are the
virtual cache's; only where the tokens lie differs.  A kernel that wants a
slot's tokens as one tensor must gather them through the block table:
`rows_kv` copies them into a reused buffer, where the virtual cache hands out
views.

The pool is one range of the VMM backend, mapped whole when the cache is made
(one call), so physical memory is committed only where blocks are written and
a production-size pool fits a replay that writes nothing.
"""
import dataclasses

import torch

from vattn.backends import Backend, get_backend
from vattn.config import CacheConfig
from vattn.kv.slots import SlotCache

_CHUNK = 2 << 20  # the pool is mapped in pieces of this size


class PagedKVCache(SlotCache):
    kind = "paged"  # rows_kv gathers through block tables

    def __init__(self, config: CacheConfig, block_size: int = 16, backend: Backend | None = None):
        """The geometry, slots and memory budget of `config`; its layout and
        page size give way to blocks of `block_size` tokens per layer."""
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        token = config.num_kv_heads * config.head_dim * config.dtype.itemsize
        super().__init__(dataclasses.replace(config, layout="per_layer", page_size=block_size * token))
        c = self.config
        self.block_size = block_size
        self.backend = backend or get_backend(c.device)
        self.device = self.backend.device
        self._zero_block = self.pool.num_pages  # one more block, never written: what rows past a table read
        blocks = self.pool.num_pages + 1
        chunk = -(-_CHUNK // self.backend.granularity) * self.backend.granularity
        chunks = -(-c.num_buffers * blocks * c.page_size // chunk)
        self._reservation = self.backend.reserve(chunks * chunk)
        self._memory = self.backend.create_pool(chunks, chunk)
        self.backend.map(self._reservation, self._memory, [i * chunk for i in range(chunks)], list(range(chunks)))
        self._bytes = self.backend.tensor(self._reservation, torch.uint8, (c.num_buffers, blocks, c.page_size),
                                          (blocks * c.page_size, c.page_size, 1))
        H, D, size = c.num_kv_heads, c.head_dim, c.dtype.itemsize
        self._pools = [self.backend.tensor(self._reservation, c.dtype, (blocks * block_size, H, D), (H * D, D, 1),
                                           b * blocks * c.page_size // size) for b in range(c.num_buffers)]
        self._gathered = [torch.empty(0, H, D, dtype=c.dtype, device=self.device) for _ in range(2)]
        # gather rows per (lo, hi, length), built once a step for every layer and dropped when a table
        # changes; the mapping worker only appends past a slot's length or takes idle and surplus
        # blocks, which rows past the lengths may read stale anyway (masked, finite)
        self._index: dict[tuple[int, int, int], torch.Tensor] = {}

    def rows_kv(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered into one buffer for K and one for V, reused by the next call."""
        self._check_layer(layer)
        index = self._index.get((lo, hi, length))
        if index is None:
            index = self._index[lo, hi, length] = self._token_rows(range(lo, hi), length)
        out = []
        for i, pool in enumerate((self._pools[2 * layer], self._pools[2 * layer + 1])):
            if self._gathered[i].shape[0] < index.numel():
                self._gathered[i] = pool.new_empty(index.numel(), *pool.shape[1:])
            buffer = self._gathered[i][:index.numel()]
            torch.index_select(pool, 0, index, out=buffer)
            out.append(buffer.view(hi - lo, length, *pool.shape[1:]))
        return out[0], out[1]

    def live_kv(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies: the gather buffer is reused."""
        k, v = super().live_kv(slot, layer)
        return k.clone(), v.clone()

    def block_table(self, slot: int) -> list[int]:
        """The blocks of the slot, in token order."""
        self._check_slot(slot)
        return list(self._slots[slot].pages)

    def _token_rows(self, slots, length: int) -> torch.Tensor:
        """Pool rows of tokens 0..length-1 of each slot, slot-major; past a
        slot's blocks, the zero block."""
        bs = self.block_size
        table = torch.full((len(slots), -(-length // bs)), self._zero_block, dtype=torch.long)
        for r, slot in enumerate(slots):
            pages = self._slots[slot].pages[:table.shape[1]]
            table[r, :len(pages)] = torch.tensor(pages, dtype=torch.long)
        rows = table[:, :, None] * bs + torch.arange(bs)
        return rows.view(len(slots), -1)[:, :length].reshape(-1).to(self.device)

    def _store(self, layer, slots, positions, key, value) -> None:
        bs, T = self.block_size, key.shape[1]
        rows = [self._slots[slot].pages[p // bs] * bs + p % bs
                for slot, pos in zip(slots, positions) for p in range(pos, pos + T)]
        rows = torch.tensor(rows, device=self.device)
        self._pools[2 * layer].index_copy_(0, rows, key.reshape(-1, *key.shape[2:]))
        self._pools[2 * layer + 1].index_copy_(0, rows, value.reshape(-1, *value.shape[2:]))

    def _pages_holding(self, slot: int, start: int, nbytes: int) -> tuple[torch.Tensor, int]:
        """The slot's blocks that hold bytes start..start+nbytes, and where start lies in the first."""
        ps = self.config.page_size
        first = start // ps
        pages = self._slots[slot].pages[first:-(-(start + nbytes) // ps)]
        return torch.tensor(pages, dtype=torch.long, device=self.device), start - first * ps

    def _read_bytes(self, slot: int, start: int, nbytes: int) -> torch.Tensor:
        if not nbytes:
            return self._bytes.new_empty(self.config.num_buffers, 0)
        pages, offset = self._pages_holding(slot, start, nbytes)
        return self._bytes[:, pages].reshape(self.config.num_buffers, -1)[:, offset:offset + nbytes]

    def _write_bytes(self, slot: int, start: int, data: torch.Tensor) -> None:
        if not data.shape[1]:
            return
        pages, offset = self._pages_holding(slot, start, data.shape[1])
        blocks = self._bytes[:, pages]
        blocks.view(self.config.num_buffers, -1)[:, offset:offset + data.shape[1]] = data
        self._bytes[:, pages] = blocks

    def _map(self, entries: list[tuple[int, int]], groups: list[int]) -> None:
        self._index.clear()  # blocks enter the tables once the caller appends them

    def _unmap(self, entries: list[tuple[int, int]]) -> None:
        self._index.clear()

    def _committed_bytes(self) -> int:
        return self.backend.committed_bytes(self._memory)
