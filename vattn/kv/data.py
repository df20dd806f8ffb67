"""The data plane: what attention and the HF cache write into a cache and read from it.

Every K/V byte a forward moves goes through here: `write` (checked, for
callers holding `[B, T, H, D]` K/V), or a forward's `check` once for every
layer and then `store` layer by layer (or `record`, where a kernel stored
the K/V itself); `views` and `rows` to read.

Where nothing backs what is not mapped (a virtual cache on CUDA), a kernel
may read only rows that are `readable`; `readable(..., fill=True)` makes a
range readable for one batched call by mapping the read-only zero page
wherever it has no page.
On the host, and in the paged cache (whose rows past a table read a block
never written), every row is readable.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vattn.kv.table import SlotTable, short_at_map_limit


@dataclass(frozen=True, slots=True)
class CheckedWrite:
    """Slots and positions `KVData.check` passed for `num_tokens` tokens in every layer."""

    slots: list[int]
    positions: list[int]
    num_tokens: int


class KVData:
    def __init__(self, table: SlotTable, kind: str):
        self.table, self.config, self.storage = table, table.config, table.storage
        self.device, self.kind = table.storage.device, kind  # kind: "virtual" or "paged", the cache's
        self.zero_backed = table.storage.zero_backed  # rows with no page behind them read as zeros

    # ------------------------------------------------------------ writes

    def write(self, layer: int, slots: Sequence[int], positions: Sequence[int], key: torch.Tensor,
              value: torch.Tensor) -> None:
        """Store `key`/`value` `[B, T, H, D]` for `slots[i]` at tokens
        `positions[i] .. positions[i]+T-1` of `layer`.  A write may overwrite or
        extend what the slot holds, not leave a gap."""
        self.table.check_layer(layer)
        slots, positions = list(slots), list(positions)
        self._check_slots(slots, positions)
        self._check_tensors(len(slots), key, value)
        self._check_positions(slots, positions, key.shape[1], layer)
        self._store(layer, CheckedWrite(slots, positions, key.shape[1]), key, value)

    def check(self, slots: Sequence[int], positions: Sequence[int], num_tokens: int) -> CheckedWrite:
        """What `write` checks of its slots and positions, for every layer at
        once (a forward writes the same positions in each): a ValueError
        unless `num_tokens` tokens may go there in any layer, which `store`
        (or a kernel, then `record`) writes layer by layer."""
        slots, positions = list(slots), list(positions)
        self._check_slots(slots, positions)
        self._check_positions(slots, positions, num_tokens, None)
        return CheckedWrite(slots, positions, num_tokens)

    def store(self, layer: int, checked: CheckedWrite, key: torch.Tensor, value: torch.Tensor) -> None:
        """`write` of `checked`'s tokens, `key`/`value [B, num_tokens, H, D]`."""
        self.table.check_layer(layer)
        self._check_tensors(len(checked.slots), key, value)
        if key.shape[1] != checked.num_tokens:
            raise ValueError(f"the write was checked for {checked.num_tokens} tokens; key has {key.shape[1]}")
        self._store(layer, checked, key, value)

    def record(self, checked: CheckedWrite, layers: range) -> None:
        """`checked`'s tokens, stored by a kernel itself in every layer of
        `layers`, recorded as written."""
        for layer in (layers[0], layers[-1]) if layers else ():
            self.table.check_layer(layer)
        for slot, pos in zip(checked.slots, checked.positions):
            written, end = self.table.slots[slot].written, pos + checked.num_tokens
            for layer in layers:
                if written[layer] < end:
                    written[layer] = end

    # ------------------------------------------------------------ reads

    def views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer` as kernels address them: whole-buffer views
        `[max_num_seqs, max_seq_len, H, D]` of a virtual cache (only
        `readable` rows may be read), the block pools `[num_blocks + 1,
        block_size, H, D]` of a paged one (the last block never written)."""
        self.table.check_layer(layer)
        return self.storage.views(layer)

    def rows(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[hi - lo, length, H, D]` of `layer`: the first `length`
        tokens of slots lo..hi-1 (views of the virtual cache; the paged one
        gathers them into a buffer its next call reuses).  Where
        `readable(lo, hi, length)`, every row may be read: past a slot's
        length it holds zeros or finite stale values; elsewhere read only
        each slot's own rows."""
        self.table.check_layer(layer)
        return self.storage.rows(layer, lo, hi, [s.pages for s in self.table.slots[lo:hi]], length)

    def readable(self, lo: int, hi: int, length: int, fill: bool = False) -> bool:
        """Whether all `length` rows of slots lo..hi-1 may be read.  Without a
        zero backing: where a fill made them so, until the cache next maps or
        unmaps; else only pages the mapping worker cannot take count (an
        active slot's, up to its capacity; not idle or spare pages).

        With `fill`, make them readable for one batched kernel call first: the
        read-only zero page goes wherever those rows have no page, and the
        pages there (any slot's, idle or active) count as readable until the
        cache next maps or unmaps, so nothing may map or unmap while that call
        runs (the engine maps a step's pages before such a forward, not during
        it).  A page grown into later takes the zero page's place.  False,
        changing nothing, only at the process's limit on mappings."""
        if fill:
            return self._fill(lo, hi, length)
        if self.storage.zero_backed:
            return True
        c, need = self.config, self.config.pages_for(length)
        filled = self.table.readable_range
        if filled is not None and filled[0] <= lo and hi <= filled[1] and need <= filled[2]:
            return True
        return all(s.active and min(len(s.pages), c.pages_for(s.capacity)) >= need
                   for s in self.table.slots[lo:hi])

    def block_tables(self, slots: list[int]) -> list[list[int]]:
        """A paged cache's block tables of `slots`, rows of one length, each
        padded with the block that is never written."""
        return self.storage.tables([self.table.slot(s).pages for s in slots])

    # ------------------------------------------------------------ inside

    @short_at_map_limit(False)
    def _fill(self, lo: int, hi: int, length: int) -> bool:
        """`readable` with `fill`."""
        t = self.table
        t.slot(lo)
        t.slot(hi - 1)
        if not lo < hi:
            raise ValueError(f"slots {lo}..{hi - 1} are no range")
        t.check_tokens(length)
        if self.storage.zero_backed:
            return True
        need = self.config.pages_for(length)
        entries = [(i, j) for i in range(lo, hi) for j in range(len(t.slots[i].pages), need)
                   if (i, j) not in t.zero_filled]
        if entries:
            self.storage.map_zero(entries)
            t.zero_filled.update(entries)
        t.readable_range = lo, hi, need
        return True

    def _store(self, layer: int, checked: CheckedWrite, key: torch.Tensor, value: torch.Tensor) -> None:
        pages = [self.table.slots[i].pages for i in checked.slots]
        self.storage.store(layer, checked.slots, pages, checked.positions, key, value)
        self.record(checked, range(layer, layer + 1))

    def _check_slots(self, slots: list[int], positions: list[int]) -> None:
        B = len(slots)
        if B == 0 or len(positions) != B:
            raise ValueError(f"write needs one position per slot, got {B} slots and {len(positions)} positions")
        if len(set(slots)) != B:
            raise ValueError(f"write got a slot twice: {slots}")

    def _check_tensors(self, B: int, key: torch.Tensor, value: torch.Tensor) -> None:
        c, device = self.config, self.storage.device
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != c.dtype or t.device != device:
                raise ValueError(f"{name} is {t.dtype} on {t.device}; the cache holds {c.dtype} on {device}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] == 0 or tuple(t.shape[2:]) != (c.num_kv_heads, c.head_dim):
                raise ValueError(f"{name} must be [{B}, T>0, {c.num_kv_heads}, {c.head_dim}], got {list(t.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} differ in shape")

    def _check_positions(self, slots: list[int], positions: list[int], T: int, layer: int | None) -> None:
        """Raise unless `T` tokens may go at `positions` of `slots` in `layer` (None: every layer)."""
        c = self.config
        for slot, pos in zip(slots, positions):
            s = self.table.active(slot)
            written = s.written[layer] if layer is not None else min(s.written)
            if not isinstance(pos, int) or not 0 <= pos <= written:
                where = f"layer {layer}" if layer is not None else "every layer"
                raise ValueError(f"position {pos!r} for slot {slot} {where} must be in "
                                 f"[0, {written}] (writes may not leave a gap)")
            if pos + T > s.capacity:
                raise ValueError(f"slot {slot} is sized for {s.capacity} tokens; writing {T} at {pos} "
                                 f"needs {pos + T}: grow it first")
            if c.pages_for(pos + T) > len(s.pages):  # past them lies nothing, or the read-only zero page
                raise ValueError(f"slot {slot} maps {len(s.pages)} pages; writing {T} tokens at {pos} "
                                 f"needs {c.pages_for(pos + T)}")
            if pos * c.token_bytes // c.page_size < self.table.shared_prefix(s):
                raise ValueError(f"writing at token {pos} of slot {slot} would change a page it shares "
                                 f"with another slot")
