"""Next-token choice: greedy, or temperature / top-k / top-p sampling from
each sequence's own generator (so a seeded sample does not depend on what
else is in the batch)."""
import torch

from vattn.sampling_params import SamplingParams


def sample_rows(logits: torch.Tensor, picks: list[tuple[int, SamplingParams, torch.Generator | None]]) -> list[int]:
    """A token for each (row of `logits [rows, vocab]`, params, generator):
    the greedy ones from one argmax over the batch, the others one by one."""
    best = logits.argmax(-1).tolist() if any(p.greedy for _, p, _ in picks) else None
    return [best[row] if p.greedy else sample(logits[row], p, g) for row, p, g in picks]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from `logits [vocab]`."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order[outside], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))
