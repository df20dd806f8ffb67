"""Next-token choice: greedy, or temperature / top-k / top-p sampling from
each sequence's own generator (so a seeded sample does not depend on what
else is in the batch), after the request's logits processors."""
import torch

from vattn.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           output_ids: list[int]) -> int:
    """One token from `logits [vocab]`, the row of a sequence that has produced `output_ids` so far."""
    logits = processed(logits, params, output_ids)
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


def processed(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """`logits` through the request's logits processors, each given its own copy."""
    for processor in params.logits_processors:
        out = processor(list(output_ids), logits.clone())
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            raise ValueError(f"a logits processor must return a tensor of shape {tuple(logits.shape)}, got "
                             f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        logits = out
    return logits
