"""How a request is sampled and when it stops (vLLM's names)."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """`temperature=0` is greedy.  With `n > 1`, sample i draws from its own
    generator seeded `seed + i`, so it equals a lone request seeded `seed + i`.
    Generation stops at `max_tokens`, at the tokenizer's end-of-sequence token
    (unless `ignore_eos`), at any of `stop_token_ids`, or when the text ends
    with one of `stop` (removed from the text, like vLLM)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens > 0, "a positive int"),
            ("n", _is_int(self.n) and self.n > 0, "a positive int"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a number ≥ 0"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int ≥ 0 (0: no limit)"),
            ("seed", self.seed is None or _is_int(self.seed), "an int or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "a list of token ids"),
        ]
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
