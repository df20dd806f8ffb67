"""The data side of `SlotCache`: what attention and the HF cache write and read."""
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CheckedWrite:
    """Slots and positions `Access.check_writes` passed for `num_tokens` tokens in every layer."""

    slots: list[int]
    positions: list[int]
    num_tokens: int


class Access:
    """Mixed into `SlotCache` (`vattn.kv.slots`), whose slots it checks."""

    def write(self, layer: int, slots: Sequence[int], positions: Sequence[int],
              key: torch.Tensor, value: torch.Tensor, store: bool = True) -> None:
        """Store `key`/`value` `[B, T, H, D]` for `slots[i]` at tokens
        `positions[i] .. positions[i]+T-1` of `layer`.  A write may overwrite or
        extend what the slot holds, not leave a gap.  With `store=False` the
        write is checked and recorded but the bytes are left to the caller's
        kernel (FlashAttention appends K/V in place)."""
        self._check_layer(layer)
        slots, positions = list(slots), list(positions)
        self._check_slots(slots, positions)
        self._check_tensors(len(slots), key, value)
        self._check_positions(slots, positions, key.shape[1], layer)
        self._store(layer, slots, positions, key, value, store)

    def check_writes(self, slots: Sequence[int], positions: Sequence[int], num_tokens: int) -> CheckedWrite:
        """What `write` checks of its slots and positions, for every layer at
        once (a forward writes the same positions in each): a ValueError
        unless `num_tokens` tokens may go there in any layer, which
        `store_checked` then writes layer by layer."""
        slots, positions = list(slots), list(positions)
        self._check_slots(slots, positions)
        self._check_positions(slots, positions, num_tokens, None)
        return CheckedWrite(slots, positions, num_tokens)

    def store_checked(self, layer: int, checked: CheckedWrite, key: torch.Tensor, value: torch.Tensor,
                      store: bool = True) -> None:
        """`write` of `checked`'s tokens, `[B, num_tokens, H, D]`."""
        self._check_layer(layer)
        self._check_tensors(len(checked.slots), key, value)
        if key.shape[1] != checked.num_tokens:
            raise ValueError(f"the write was checked for {checked.num_tokens} tokens; key has {key.shape[1]}")
        self._store(layer, checked.slots, checked.positions, key, value, store)

    def record_checked(self, checked: CheckedWrite, layers: range) -> None:
        """`checked`'s tokens, which a kernel stored itself in every layer of
        `layers`, recorded as written (`store_checked` with `store=False`, for
        many layers at once)."""
        for layer in (layers[0], layers[-1]) if layers else ():
            self._check_layer(layer)
        self._record(layers, checked.slots, checked.positions, checked.num_tokens)

    def _store(self, layer, slots, positions, key, value, store) -> None:
        if store:
            self.storage.store(layer, slots, [self._slots[i].pages for i in slots], positions, key, value)
        self._record((layer,), slots, positions, key.shape[1])

    def _record(self, layers, slots, positions, num_tokens) -> None:
        for slot, pos in zip(slots, positions):
            written, end = self._slots[slot].written, pos + num_tokens
            for layer in layers:
                if written[layer] < end:
                    written[layer] = end

    def _check_slots(self, slots: list[int], positions: list[int]) -> None:
        B = len(slots)
        if B == 0 or len(positions) != B:
            raise ValueError(f"write needs one position per slot, got {B} slots and {len(positions)} positions")
        if len(set(slots)) != B:
            raise ValueError(f"write got a slot twice: {slots}")

    def _check_tensors(self, B: int, key: torch.Tensor, value: torch.Tensor) -> None:
        c = self.config
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != c.dtype or t.device != self.device:
                raise ValueError(f"{name} is {t.dtype} on {t.device}; the cache holds {c.dtype} on {self.device}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] == 0 or tuple(t.shape[2:]) != (c.num_kv_heads, c.head_dim):
                raise ValueError(f"{name} must be [{B}, T>0, {c.num_kv_heads}, {c.head_dim}], got {list(t.shape)}")
        if key.shape != value.shape:
            raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} differ in shape")

    def _check_positions(self, slots: list[int], positions: list[int], T: int, layer: int | None) -> None:
        """Raise unless `T` tokens may go at `positions` of `slots` in `layer` (None: every layer)."""
        c = self.config
        for slot, pos in zip(slots, positions):
            s = self._active(slot)
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
            if pos * c.token_bytes // c.page_size < self._shared_prefix(s):
                raise ValueError(f"writing at token {pos} of slot {slot} would change a page it shares "
                                 f"with another slot")

    def rows_kv(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[hi - lo, length, H, D]` of `layer`: the first `length`
        tokens of slots lo..hi-1, for kernels given each slot's length.  Where
        `readable(lo, hi, length)`, every row is safe to read: past a slot's
        length it holds zeros or finite stale values; elsewhere read only
        each slot's own rows."""
        self._check_layer(layer)
        return self.storage.rows(layer, lo, hi, [s.pages for s in self._slots[lo:hi]], length)

    def readable(self, lo: int, hi: int, length: int) -> bool:
        """Whether all `length` rows of slots lo..hi-1 may be read.  Without a
        zero backing: where `zero_fill` made them so, until the cache next
        maps or unmaps; else only pages the mapping worker cannot take count
        (an active slot's, up to its capacity; not idle or spare pages)."""
        c = self.config
        need = c.pages_for(length)
        if self.storage.zero_backed:
            return True
        filled = self._readable_range
        if filled is not None and filled[0] <= lo and hi <= filled[1] and need <= filled[2]:
            return True
        return all(s.active and min(len(s.pages), c.pages_for(s.capacity)) >= need for s in self._slots[lo:hi])

    def live_kv(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[written, H, D]` K and V of the tokens the slot has written in
        `layer`: views of the virtual cache, copies of what the paged one gathers."""
        s = self._active(slot)
        k, v = self.rows_kv(layer, slot, slot + 1, s.written[layer])
        return (k[0], v[0]) if self.storage.views else (k[0].clone(), v[0].clone())
