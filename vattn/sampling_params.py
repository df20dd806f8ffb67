"""How a request is sampled and when it stops (vLLM's names)."""
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vattn.checks import is_int, is_number

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
SEEDS = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class SamplingParams:
    """`temperature` below 1e-5 is greedy.  With `n > 1`, sample i draws from
    its own generator seeded `seed + i`, so it equals a lone request seeded
    `seed + i`.  Generation stops at `max_tokens`, at the tokenizer's
    end-of-sequence token (unless `ignore_eos`), at any of `stop_token_ids`,
    or when the text ends with one of `stop` (removed from the text, like
    vLLM).  `logits_processors` are called in order on each sample's row of
    logits before it is sampled, as `processor(output_token_ids, logits)`
    returning the row to sample from (vLLM's per-request processors); one
    that raises ends its request with an error and nothing else.

    With vLLM's meanings: `logit_bias` adds to token ids' logits (each bias
    clamped to [-100, 100]); until `min_tokens` tokens are out, the
    end-of-sequence and `stop_token_ids` cannot be sampled;
    `repetition_penalty` divides the positive logits of tokens in the prompt
    or the output and multiplies the negative ones; `frequency_penalty` and
    `presence_penalty` subtract, per token of the output, its count and
    whether it occurs.  Then come the logits processors, then temperature,
    top-k and top-p.  `logprobs` = k returns with each token its
    log-probability and the k most likely tokens' (from the model's logits,
    before any of the above, as vLLM's default)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        n_ok = is_int(self.n) and self.n > 0
        checks = [
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens > 0, "a positive int"),
            ("n", n_ok, "a positive int"),
            ("temperature", is_number(self.temperature) and self.temperature >= 0, "a number ≥ 0"),
            ("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "an int ≥ 0 (0: no limit)"),
            ("seed", self.seed is None or (is_int(self.seed) and n_ok and SEEDS[0] <= self.seed
                                           and self.seed + self.n - 1 <= SEEDS[1]),
             f"an int or None, with seed + n - 1 in [{SEEDS[0]}, {SEEDS[1]}] (sample i is seeded seed + i)"),
            ("stop", _is_list(self.stop, lambda s: isinstance(s, str) and s != ""),
             "a non-empty string or a list of them"),
            ("stop_token_ids", _is_list(self.stop_token_ids, lambda t: is_int(t) and t >= 0), "a list of token ids"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("logits_processors", _is_list(self.logits_processors, callable), "a list of callables"),
            ("min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "an int in [0, max_tokens]"),
            ("presence_penalty", is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "a number in [-2, 2]"),
            ("frequency_penalty", is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "a number in [-2, 2]"),
            ("repetition_penalty", is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2**32,
             "a number > 0"),
            ("logit_bias", isinstance(self.logit_bias, dict) and all(
                is_int(t) and t >= 0 and is_number(b) for t, b in self.logit_bias.items()),
             "a dict of token ids to numbers"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"None or an int in [0, {MAX_LOGPROBS}]"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def shapes_logits(self) -> bool:
        """Whether anything changes the model's logits before the choice."""
        return bool(self.logits_processors or self.logit_bias or self.min_tokens or self.presence_penalty
                    or self.frequency_penalty or self.repetition_penalty != 1)


def _is_list(x, each) -> bool:
    return isinstance(x, (list, tuple)) and all(each(v) for v in x)
