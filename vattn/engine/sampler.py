"""Next-token choice: greedy, or temperature / top-k / top-p sampling from
each sequence's own generator (so a seeded sample does not depend on what
else is in the batch), after the request's logit bias, minimum length,
penalties and logits processors (`SamplingParams`)."""
from collections.abc import Collection

import torch

from vattn.sampling_params import SamplingParams

BIAS_LIMIT = 100.0  # vLLM clamps each logit bias to ±100


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           token_ids: list[int], prompt_len: int, stop_ids: Collection[int]) -> int:
    """One token from `logits [vocab]`, the row of a sequence whose tokens
    (prompt, then output) are `token_ids`; `stop_ids` end it (held back
    until `min_tokens`)."""
    logits = processed(logits, params, token_ids, prompt_len, stop_ids)
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


def processed(logits: torch.Tensor, params: SamplingParams, token_ids: list[int], prompt_len: int,
              stop_ids: Collection[int]) -> torch.Tensor:
    """`logits` as the request's settings shape them, in vLLM's order."""
    p, output_ids = params, token_ids[prompt_len:]
    if p.logit_bias or p.min_tokens or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
        logits = logits.to(torch.float32, copy=True)  # the forward's rows stay as they are
        vocab = logits.numel()
        for token, bias in p.logit_bias.items():
            if token < vocab:
                logits[token] += max(-BIAS_LIMIT, min(BIAS_LIMIT, bias))
        if len(output_ids) < p.min_tokens:
            held = [t for t in (*stop_ids, *p.stop_token_ids) if t < vocab]
            logits[held] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted({t for t in token_ids if t < vocab}), dtype=torch.long)
            row = logits[seen]
            logits[seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids:
            counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].float()
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    for processor in p.logits_processors:
        out = processor(list(output_ids), logits.clone())
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            raise ValueError(f"a logits processor must return a tensor of shape {tuple(logits.shape)}, got "
                             f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        logits = out
    return logits


def logprobs(logits: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """The log-probabilities of `token` and of the `k` most likely tokens
    (sampled token first) under `logits [vocab]` as the model gave them."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(k) if k else None
    out = {token: float(lp[token])}
    if top is not None:
        out.update((int(t), float(v)) for v, t in zip(top.values, top.indices) if int(t) != token)
    return out
