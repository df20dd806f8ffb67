"""The virtual KV cache.

Every buffer (one per layer and K/V, one per layer, K/V and head, or one in
all, by the layout) is reserved up front for `max_num_seqs` slots of
`max_seq_len` tokens; page j of a slot in every buffer is one page
(`vattn.kv.slots`), mapped on demand by the VMM backend.  Kernels read a
layer's K and V as ordinary strided tensors over the reservation.

On the host the whole reservation is zero-backed: an address with no page
reads as zeros, so kernels that read the whole-buffer views past a slot's
length cannot fault.  CUDA has no such backing: kernels read a slot's rows
only as far as its pages reach (`readable`), FlashAttention and the Triton
kernel as far as the lengths they are given; for one batched call over a
range of slots, `KVData.readable(..., fill=True)` maps one read-only zero page
where it has none.

With a `member` of a shared pool (`vattn.kv.shared`) the pages are the
member's, in the chunks it holds of the pool's physical memory.
"""
import dataclasses

import torch

from vattn.backends import Backend, get_backend
from vattn.config import CacheConfig, resolve
from vattn.kv.slots import SlotCache

__all__ = ["VirtualKVCache", "VirtualStorage"]


class VirtualStorage:
    """Pages mapped into one reservation holding every buffer."""

    def __init__(self, config: CacheConfig, backend: Backend, member=None):
        c = self.config = config
        self.backend, self.device, self.member = backend, backend.device, member
        if member is None:
            self.physical = backend.create_pool(c.num_pages * c.num_buffers, c.page_size)
        else:
            self.physical = backend.view(member.pool.physical, c.page_size)
        self._buffer_bytes = c.max_num_seqs * c.slot_bytes
        self.reservation = backend.reserve(c.num_buffers * self._buffer_bytes, zero_backed=backend.zero_backing)
        self.zero_backed = self.reservation.zero_backed
        self._entries = backend.map_entries()
        self.bytes = backend.tensor(self.reservation, torch.uint8, (c.num_buffers, c.max_num_seqs, c.slot_bytes),
                                     (self._buffer_bytes, c.slot_bytes, 1))
        self.k = [self._kernel_view(2 * layer) for layer in range(c.num_layers)]
        self.v = [self._kernel_view(2 * layer + 1) for layer in range(c.num_layers)]
        self._last_scatter = None, None  # (slots, positions, T) of the last scattered write, its index

    def _kernel_view(self, component: int) -> torch.Tensor:
        """`[max_num_seqs, max_seq_len, H, D]` over K (even) or V (odd) of a layer."""
        c = self.config
        size = c.dtype.itemsize
        H, D = c.num_kv_heads, c.head_dim
        buffer = self._buffer_bytes // size
        head, start = {"per_layer": (D, component * buffer),  # buffer 2l+kv, heads within a token
                       "per_head": (buffer, component * H * buffer),  # buffer (2l+kv)·H + h
                       "interleaved": (D, component * H * D)}[c.layout]  # [..., l, kv, h, d] in a token
        return self.backend.tensor(self.reservation, c.dtype, (c.max_num_seqs, c.max_seq_len, H, D),
                                   (c.slot_bytes // size, c.token_bytes // size, head, 1), start)

    def draw_entries(self, n: int) -> None:
        self._entries.draw(n * self.config.num_buffers)

    def map(self, entries, pages) -> None:
        self.backend.map(self.reservation, self.physical, self._offsets(entries), self._physical_pages(pages))

    def map_zero(self, entries) -> None:
        self.backend.map_zero(self.reservation, self.physical, self._offsets(entries))

    def unmap(self, entries) -> None:
        self.backend.unmap(self.reservation, self.physical, self._offsets(entries))

    def release(self, pages) -> None:
        self.backend.release(self.physical, self._physical_pages(pages))

    def committed_bytes(self) -> int:
        if self.member is not None:
            return self.member.held * self.member.pool.chunk_size
        return self.backend.committed_bytes(self.physical)

    def read(self, slot, table, start, nbytes) -> torch.Tensor:
        return self.bytes[:, slot, start:start + nbytes]

    def write(self, slot, table, start, data) -> None:
        self.bytes[:, slot, start:start + data.shape[1]].copy_(data)

    def store(self, layer, slots, tables, positions, key, value) -> None:
        K, V = self.k[layer], self.v[layer]
        B, T = key.shape[:2]
        first, pos = slots[0], positions[0]
        if slots == list(range(first, first + B)) and positions == [pos] * B:  # one strided copy
            K[first:first + B, pos:pos + T] = key
            V[first:first + B, pos:pos + T] = value
        else:
            K.index_put_(self._scatter_index(slots, positions, T), key)
            V.index_put_(self._scatter_index(slots, positions, T), value)

    def views(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def rows(self, layer, lo, hi, tables, length) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][lo:hi, :length], self.v[layer][lo:hi, :length]

    def _scatter_index(self, slots: list[int], positions: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the tokens a write puts at scattered slots: made
        once for every layer of a step (on CUDA each is a copy to the device)."""
        key = (tuple(slots), tuple(positions), T)
        if self._last_scatter[0] != key:
            rows = torch.tensor(slots, device=self.device).unsqueeze(1).expand(len(slots), T)
            cols = torch.tensor(positions, device=self.device).unsqueeze(1) + torch.arange(T, device=self.device)
            self._last_scatter = key, (rows, cols)
        return self._last_scatter[1]

    def _offsets(self, entries: list[tuple[int, int]]) -> list[int]:
        """Byte offsets of (slot, page index) in every buffer, buffer-major."""
        c = self.config
        slot_pages = [i * c.slot_bytes + j * c.page_size for i, j in entries]
        return [b * self._buffer_bytes + o for b in range(c.num_buffers) for o in slot_pages]

    def _physical_pages(self, pages: list[int]) -> list[int]:
        """Physical pages of pages, buffer-major: page p of buffer b is physical
        page b·P + p, so consecutive pages are consecutive per buffer (in a
        shared pool, within each chunk: `PoolMember.physical_pages`)."""
        if self.member is not None:
            return self.member.physical_pages(pages, self.config.num_buffers)
        P = self.config.num_pages
        return [b * P + p for b in range(self.config.num_buffers) for p in pages]


class VirtualKVCache(SlotCache):
    kind = "virtual"  # kernels read whole-buffer views (`KVData.views`)

    def __init__(self, config: CacheConfig, backend: Backend | None = None, member=None):
        """With `member` (a `PoolMember`) the cache draws on that shared pool,
        whose budget replaces `config.memory_budget`."""
        if member is not None:
            backend = member.pool.backend
            if torch.device(config.device).type != backend.device.type:
                raise ValueError(f"a cache on {config.device} cannot draw on a pool on {backend.device}")
            config = dataclasses.replace(config, memory_budget=member.pool.memory_budget)
        backend = backend or get_backend(config.device)
        config = resolve(config, backend)
        super().__init__(config, VirtualStorage(config, backend, member), member)
        self.backend = backend
