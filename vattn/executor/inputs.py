"""What a forward computes, as plain data: what the engine hands the model
runner, and rank 0 sends every other tensor-parallel rank."""
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StepInputs:
    """The slots and positions of the work of one token (a decode, or a
    prompt's last token alone: the attention kernels decode both), the
    chunks of several tokens (slot, first position, tokens), every token id
    in the forward's order, and the rows whose logits sample."""

    decode_slots: list[int]
    decode_positions: list[int]
    chunks: list[tuple[int, int, int]]
    token_ids: list[int]
    sample_rows: list[int]
