"""Requests, their sequences (one per sample) and what the engine hands back."""
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vattn.kv.sharing import SwappedSlot
from vattn.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its sequences' KV is in host memory
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens, how many of them are in the cache
    (the cache API keys its slot by the sequence itself), and its KV in host
    memory while preempted by swap."""

    index: int
    token_ids: list[int]
    prompt_len: int
    generator: torch.Generator | None  # None: greedy
    num_computed_tokens: int = 0
    swapped: SwappedSlot | None = None
    finish_reason: str | None = None  # "stop", "length", or "error"
    stop_at: int | None = None  # output characters kept when a stop string ended it
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked for

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the cache; the last of them is fed to sample the next."""
        return len(self.token_ids) - self.num_computed_tokens


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    seqs: list["Sequence"] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each step's new tokens came out
    finish_time: float | None = None
    scheduled_time: float | None = None  # first admitted to run
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit spared from prefill
    seed: int = 0
    error: str | None = None  # why it ended in error, if it did

    def __post_init__(self):
        self.seed = self.params.seed if self.params.seed is not None else int(torch.randint(0, 2**62, ()))
        self.seqs = [self.new_sequence(0)]

    def new_sequence(self, index: int) -> Sequence:
        """Sample `index`: the prompt, and a generator seeded `seed + index`."""
        generator = None if self.params.greedy else torch.Generator().manual_seed(self.seed + index)
        return Sequence(index, list(self.prompt_token_ids), len(self.prompt_token_ids), generator)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        """Samples 1..n-1 are forked when the prompt is done, so until then
        the first sample is unfinished."""
        return all(s.finished for s in self.seqs)


class CompletionOutput:
    """One sample's output.  `text` may be given as a function of nothing that
    decodes it: it is then decoded when first read, so a step does not decode
    every sequence's whole text again for callers that read only token ids."""

    __slots__ = ("index", "_text", "token_ids", "finish_reason", "new_token_ids", "logprobs")

    def __init__(self, index: int, text: str | Callable[[], str], token_ids: list[int], finish_reason: str | None,
                 new_token_ids: list[int] | None = None, logprobs: list[dict[int, float]] | None = None):
        self.index, self._text, self.token_ids, self.finish_reason = index, text, token_ids, finish_reason
        self.new_token_ids = [] if new_token_ids is None else new_token_ids  # came out in the step that returned this
        # with SamplingParams.logprobs: per output token, {token id: log-probability}, the sampled token first
        self.logprobs = logprobs

    @property
    def text(self) -> str:
        if not isinstance(self._text, str):
            self._text = self._text()
        return self._text

    def _fields(self) -> tuple:
        return self.index, self.text, self.token_ids, self.finish_reason, self.new_token_ids

    def __eq__(self, other) -> bool:
        return self._fields() == other._fields() if isinstance(other, CompletionOutput) else NotImplemented

    def __repr__(self) -> str:
        return "CompletionOutput(index={!r}, text={!r}, token_ids={!r}, finish_reason={!r}, new_token_ids={!r})".format(
            *self._fields())


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    token_times: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens a prefix-cache hit spared from prefill
    scheduled_time: float | None = None  # first admitted to run


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request ended in error: its samples' finish_reason is "error"
