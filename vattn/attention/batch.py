"""`StepBatch`: what one forward holds, as its attention reads it.

One forward holds several requests back to back (`input_ids [1, T]`): first
one token for each of `decode_slots` (a decoding sequence's next token, or a
prompt's last token fed alone), then prefill chunks.
"""
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class StepBatch:
    decode_slots: list[int]
    decode_positions: list[int]  # where each one-token request's token goes
    chunks: list[tuple[int, int, int]]  # (slot, first position, tokens) of each prefill chunk

    @property
    def num_tokens(self) -> int:
        return len(self.decode_slots) + sum(n for _, _, n in self.chunks)

    def positions(self, device: torch.device) -> torch.Tensor:
        """`[1, T]`: every token's position, as a model takes them."""
        return torch.cat([torch.tensor([self.decode_positions], dtype=torch.long, device=device),
                          *(torch.arange(start, start + n, device=device)[None] for _, start, n in self.chunks)], 1)

    def prefill_chunks(self) -> Iterator[tuple[int, int, slice]]:
        """(slot, first position, the chunk's rows among the forward's tokens) of each prefill chunk."""
        first = len(self.decode_slots)
        for slot, start, n in self.chunks:
            yield slot, start, slice(first, first + n)
            first += n

    def decode_rows(self) -> tuple[int, int]:
        """The slot range a batched decode call covers."""
        return min(self.decode_slots), max(self.decode_slots) + 1
