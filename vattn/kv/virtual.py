"""The virtual KV cache.

Every buffer (one per layer and K/V, one per layer, K/V and head, or one in
all, by the layout) is reserved up front for `max_batch` slots of
`max_seq_len` tokens; page j of a slot in every buffer is one page group
(`vattn.kv.slots`), mapped on demand by the VMM backend.  Kernels read a
layer's K and V as ordinary strided tensors over the reservation.

On the host the whole reservation is zero-backed: an address with no page
reads as zeros, so kernels that read the whole-buffer views past a slot's
length cannot fault.  CUDA has no such zero page: kernels read a slot's rows
only as far as its pages reach (`readable`), and FlashAttention as far as the
lengths it is given.
"""
import torch

from vattn.backends import Backend, MapLimitError, get_backend
from vattn.config import CacheConfig
from vattn.kv.slots import CacheStats, SlotCache, SwappedSlot

__all__ = ["CacheStats", "SwappedSlot", "VirtualKVCache"]


class VirtualKVCache(SlotCache):
    kind = "virtual"  # layer_kv hands kernels whole-buffer views

    def __init__(self, config: CacheConfig, backend: Backend | None = None):
        super().__init__(config)
        c = config
        self.backend = backend or get_backend(c.device)
        self.backend.check_page_size(c.page_size)
        self.device = self.backend.device
        self._buffer_bytes = c.max_batch * c.slot_bytes
        self._reservation = self.backend.reserve(c.num_buffers * self._buffer_bytes,
                                                 zero_backed=self.backend.zero_backing)
        self._physical = self.backend.create_pool(self.pool.num_pages * c.num_buffers, c.page_size)
        self._bytes = self.backend.tensor(self._reservation, torch.uint8,
                                          (c.num_buffers, c.max_batch, c.slot_bytes),
                                          (self._buffer_bytes, c.slot_bytes, 1))
        self._k = [self._kernel_view(2 * layer) for layer in range(c.num_layers)]
        self._v = [self._kernel_view(2 * layer + 1) for layer in range(c.num_layers)]
        self._last_scatter = None, None  # (slots, positions, T) of the last scattered write, its index

    def _kernel_view(self, component: int) -> torch.Tensor:
        """`[max_batch, max_seq_len, H, D]` over K (even) or V (odd) of a layer."""
        c = self.config
        size = c.dtype.itemsize
        H, D = c.num_kv_heads, c.head_dim
        buffer = self._buffer_bytes // size
        head, start = {"per_layer": (D, component * buffer),  # buffer 2l+kv, heads within a token
                       "per_head": (buffer, component * H * buffer),  # buffer (2l+kv)·H + h
                       "interleaved": (D, component * H * D)}[c.layout]  # [..., l, kv, h, d] in a token
        return self.backend.tensor(self._reservation, c.dtype, (c.max_batch, c.max_seq_len, H, D),
                                   (c.slot_bytes // size, c.token_bytes // size, head, 1), start)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-buffer K and V of `layer`, `[max_batch, max_seq_len, H, D]`, for
        kernels given each slot's length.  On the host every row is safe to
        read (past a slot's length it holds zeros or finite stale values); on
        CUDA only the rows of mapped pages (`readable`)."""
        self._check_layer(layer)
        return self._k[layer], self._v[layer]

    def rows_kv(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        K, V = self.layer_kv(layer)
        return K[lo:hi, :length], V[lo:hi, :length]

    def readable(self, lo: int, hi: int, length: int) -> bool:
        """Without the zero page: only pages the mapping worker cannot take
        count (an active slot's, up to its size; not idle or spare pages)."""
        c = self.config
        need = c.pages_for(length)
        return self._reservation.zero_backed or all(
            s.active and min(len(s.pages), c.pages_for(s.tokens)) >= need for s in self._slots[lo:hi])

    def _store(self, layer, slots, positions, key, value) -> None:
        K, V = self._k[layer], self._v[layer]
        B, T = key.shape[:2]
        first, pos = slots[0], positions[0]
        if slots == list(range(first, first + B)) and positions == [pos] * B:  # one strided copy
            K[first:first + B, pos:pos + T] = key
            V[first:first + B, pos:pos + T] = value
        else:
            K.index_put_(self._scatter_index(slots, positions, T), key)
            V.index_put_(self._scatter_index(slots, positions, T), value)

    def _scatter_index(self, slots: list[int], positions: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, columns) of the tokens a write puts at scattered slots: made
        once for every layer of a step (on CUDA each is a copy to the device)."""
        key = (tuple(slots), tuple(positions), T)
        if self._last_scatter[0] != key:
            rows = torch.tensor(slots, device=self.device).unsqueeze(1).expand(len(slots), T)
            cols = torch.tensor(positions, device=self.device).unsqueeze(1) + torch.arange(T, device=self.device)
            self._last_scatter = key, (rows, cols)
        return self._last_scatter[1]

    def _read_bytes(self, slot: int, start: int, nbytes: int) -> torch.Tensor:
        return self._bytes[:, slot, start:start + nbytes]

    def _write_bytes(self, slot: int, start: int, data: torch.Tensor) -> None:
        self._bytes[:, slot, start:start + data.shape[1]].copy_(data)

    def _map(self, entries: list[tuple[int, int]], groups: list[int]) -> None:
        """At the process's limit on mappings, idle slots' pages (which hold
        mapping entries too) are unmapped and the call tried once more."""
        if not entries:
            return
        args = self._reservation, self._physical, self._offsets(entries), self._physical_pages(groups)
        try:
            self.backend.map(*args)
        except MapLimitError:
            idle = sum(len(s.pages) for s in self._slots if not s.active)
            if not idle:
                raise
            self._reclaim(idle, {})  # idle slots come first, so only they are cut
            self.backend.map(*args)
        self.map_calls += 1

    def _unmap(self, entries: list[tuple[int, int]]) -> None:
        self.backend.unmap(self._reservation, self._physical, self._offsets(entries))
        self.unmap_calls += 1

    def _release(self, groups: list[int]) -> None:
        self.backend.release(self._physical, self._physical_pages(groups))

    def _committed_bytes(self) -> int:
        return self.backend.committed_bytes(self._physical)

    def _offsets(self, entries: list[tuple[int, int]]) -> list[int]:
        """Byte offsets of (slot, page index) in every buffer, buffer-major."""
        c = self.config
        slot_pages = [i * c.slot_bytes + j * c.page_size for i, j in entries]
        return [b * self._buffer_bytes + o for b in range(c.num_buffers) for o in slot_pages]

    def _physical_pages(self, groups: list[int]) -> list[int]:
        """Physical pages of page groups, buffer-major: group g of buffer b is
        page b·G + g, so consecutive groups are consecutive pages per buffer."""
        G = self.pool.num_pages
        return [b * G + g for b in range(self.config.num_buffers) for g in groups]
