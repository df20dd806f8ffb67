"""The step plan: what one forward computes, as the scheduler decided it
(vLLM's `SchedulerOutput`).  The model runner reads its inputs
(`vattn.executor.inputs.StepInputs`, plain data every tensor-parallel rank
receives); the scheduler's `update` takes it back once the forward is done."""
from dataclasses import dataclass, field

from vattn.engine.request import Request, Sequence
from vattn.executor.inputs import StepInputs


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
    single_tokens: list[Work] = field(default_factory=list)  # a decode, or a prompt's last token alone
    chunks: list[Work] = field(default_factory=list)  # several tokens each: prompt chunks (or recomputed history)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)  # ended while being scheduled

    @property
    def work(self) -> list[Work]:
        """In the forward's order: single tokens first (the kernels decode them), then the chunks."""
        return self.single_tokens + self.chunks

    @property
    def num_tokens(self) -> int:
        return len(self.single_tokens) + sum(w.num_tokens for w in self.chunks)

    def add(self, work: Work) -> None:
        (self.single_tokens if work.num_tokens == 1 else self.chunks).append(work)

    def inputs(self) -> StepInputs:
        """The forward as plain data, for the model runner (and every tensor-parallel rank)."""
        ids, rows = [], []
        for w in self.work:
            ids += w.seq.token_ids[w.start:w.start + w.num_tokens]
            if w.samples:
                rows.append(len(ids) - 1)
        return StepInputs([w.slot for w in self.single_tokens], [w.start for w in self.single_tokens],
                          [(w.slot, w.start, w.num_tokens) for w in self.chunks], ids, rows)

    def by_request(self) -> dict[Request, list[tuple[Work, int | None]]]:
        """Each request's work, with the row of the forward's logits it
        samples from (None: a prompt chunk short of the prompt's end)."""
        out, row = {}, 0
        for w in self.work:
            out.setdefault(w.request, []).append((w, row if w.samples else None))
            row += w.samples
        return out
