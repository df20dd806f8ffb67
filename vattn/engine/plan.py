"""The step plan: what one forward computes, as the scheduler decided it
(vLLM's `SchedulerOutput`).  The model runner reads its inputs
(`StepInputs`, plain data every tensor-parallel rank receives); the
scheduler's `update` takes it back once the forward is done."""
from dataclasses import dataclass, field

from vattn.engine.request import Request, Sequence


@dataclass(slots=True, frozen=True)
class Work:
    """`num_tokens` tokens of a sequence from position `start`, in `slot`."""

    request: Request
    seq: Sequence
    slot: int
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this work reaches the sequence's last token, so it samples the next."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class StepPlan:
    decodes: list[Work] = field(default_factory=list)  # one token each
    prefills: list[Work] = field(default_factory=list)  # prompt chunks (or recomputed history)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # ended while being scheduled

    @property
    def work(self) -> list[Work]:
        """In the forward's order: decode tokens first, then the chunks."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(w.num_tokens for w in self.prefills)

    def add(self, work: Work) -> None:
        (self.decodes if work.num_tokens == 1 else self.prefills).append(work)

    def by_request(self) -> dict[Request, list[tuple[Work, int | None]]]:
        """Each request's work, with the row of the forward's logits it
        samples from (None: a prompt chunk short of the prompt's end)."""
        out, row = {}, 0
        for w in self.work:
            out.setdefault(w.request, []).append((w, row if w.samples else None))
            row += w.samples
        return out


@dataclass(slots=True, frozen=True)
class StepInputs:
    """A plan's forward as plain data: the decode tokens' slots and
    positions, the prefill chunks (slot, first position, tokens), every
    token id in the forward's order, and the rows whose logits sample."""

    decode_slots: list[int]
    decode_positions: list[int]
    chunks: list[tuple[int, int, int]]
    token_ids: list[int]
    sample_rows: list[int]

    @classmethod
    def of(cls, plan: StepPlan) -> "StepInputs":
        ids, rows = [], []
        for w in plan.work:
            ids += w.seq.token_ids[w.start:w.start + w.num_tokens]
            if w.samples:
                rows.append(len(ids) - 1)
        return cls([w.slot for w in plan.decodes], [w.start for w in plan.decodes],
                   [(w.slot, w.start, w.num_tokens) for w in plan.prefills], ids, rows)
