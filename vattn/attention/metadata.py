"""`StepBatch`: what one forward holds, and the per-step tensors its kernels share.

One forward holds several requests back to back (`input_ids [1, T]`): first
one decode token for each of `decode_slots`, then prefill chunks.
"""
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vattn.attention.native import requests
from vattn.kv.slots import SlotCache

if TYPE_CHECKING:
    from vattn.attention.registry import Kernel


@dataclass(slots=True)
class StepBatch:
    cache: SlotCache
    decode_slots: list[int]
    decode_positions: list[int]  # where each decode token goes
    chunks: list[tuple[int, int, int]]  # (slot, first position, tokens) of each prefill chunk
    kernel: "Kernel | None" = None  # what runs the attention (None: the registry's pick for the cache)
    _masks: dict = field(default_factory=dict)  # decode masks and kernel arguments, built once per step
    _rows: torch.Tensor | None = None  # decode slots - lo, built once per step
    per_request_decodes: int = 0  # layers whose decode tokens took one kernel call per request
    _checked: list | None = None  # the step's writes as the cache checked them, once for every layer

    def __post_init__(self):
        if self.kernel is None:
            from vattn.attention import registry  # the registry imports the kernels, which take a StepBatch

            self.kernel = registry.pick_for(self.cache)

    @property
    def num_tokens(self) -> int:
        return len(self.decode_slots) + sum(n for _, _, n in self.chunks)

    def positions(self) -> torch.Tensor:
        """`[1, T]`: every token's position, on the cache's device."""
        device = self.cache.device
        return torch.cat([torch.tensor([self.decode_positions], dtype=torch.long, device=device),
                          *(torch.arange(start, start + n, device=device)[None] for _, start, n in self.chunks)], 1)

    def prefill_chunks(self) -> Iterator[tuple[int, int, slice]]:
        """(slot, first position, the chunk's rows among the forward's tokens) of each prefill chunk."""
        first = len(self.decode_slots)
        for slot, start, n in self.chunks:
            yield slot, start, slice(first, first + n)
            first += n

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, store: bool = True) -> None:
        """Store this forward's `[T, H_kv, D]` K/V of `layer` at each request's
        positions (with `store=False` only check and record it: the kernel
        appends it).  The positions are checked once, for every layer."""
        d = len(self.decode_slots)
        writes = iter(self.checked_writes())
        if d:
            self.cache.store_checked(layer, next(writes), key[:d, None], value[:d, None], store)
        for (_, _, rows), checked in zip(self.prefill_chunks(), writes):
            self.cache.store_checked(layer, checked, key[None, rows], value[None, rows], store)

    def checked_writes(self) -> list:
        """The step's writes (its decode tokens, then each prefill chunk) as the
        cache checked them, once for every layer: a ValueError where one may
        not go where it would."""
        if self._checked is None:
            self._checked = ([self.cache.check_writes(self.decode_slots, self.decode_positions, 1)]
                             if self.decode_slots else []) + [
                self.cache.check_writes([slot], [start], n) for slot, start, n in self.chunks]
        return self._checked

    def record(self, layers: range) -> None:
        """The step's K/V of `layers`, stored by the kernel itself, recorded in
        the cache's books (`write` with `store=False`, every layer at once)."""
        for checked in self.checked_writes():
            self.cache.record_checked(checked, layers)

    def requests(self):
        """The native kernel's request table: a request per decode token and per
        prefill chunk, each reading its slot's rows up to its last token."""
        if "requests" not in self._masks:
            decodes = enumerate(zip(self.decode_slots, self.decode_positions))
            self._masks["requests"] = requests(
                [(slot, 0, pos + 1, i, 1) for i, (slot, pos) in decodes]
                + [(slot, 0, start + rows.stop - rows.start, rows.start, rows.stop - rows.start)
                   for slot, start, rows in self.prefill_chunks()])
        return self._masks["requests"]

    def decode_rows(self) -> tuple[int, int]:
        """The slot range a batched decode call covers."""
        return min(self.decode_slots), max(self.decode_slots) + 1

    def decode_row_index(self) -> torch.Tensor:
        """Where each decode token's slot sits in that range."""
        if self._rows is None:
            self._rows = torch.tensor(self.decode_slots, device=self.cache.device) - self.decode_rows()[0]
        return self._rows

    def tensor(self, name: str, values) -> torch.Tensor:
        """`values` (ints, nested lists of them, or a function making them) as
        int32 on the cache's device, made once a step."""
        if name not in self._masks:
            values = values() if callable(values) else values
            self._masks[name] = torch.tensor(values, dtype=torch.int32, device=self.cache.device)
        return self._masks[name]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """`[R, 1, 1, L]`: row r attends to the live tokens of slot lo + r (if decoding)."""
        if window not in self._masks:
            lo, hi = self.decode_rows()
            L = max(self.decode_positions) + 1
            device = self.cache.device
            pos = torch.zeros(hi - lo, dtype=torch.long, device=device)  # a slot not decoding sees its token 0
            pos[self.decode_row_index()] = torch.tensor(self.decode_positions, device=device)
            kv = torch.arange(L, device=device)
            mask = kv <= pos[:, None]
            if window is not None:
                mask &= kv > pos[:, None] - window
            self._masks[window] = mask[:, None, None, :]
        return self._masks[window]
