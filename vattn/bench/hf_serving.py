"""The peers vattn's engine is compared against end to end, serving the same
requests and reporting the same figures: transformers' own continuous batching
(paged cache) and `model.generate` over static batches (DynamicCache).

Requests are greedy and stop at `max_tokens` or at the model's eos (kept in
the output), as in the engine.  They all arrive when the clock starts, and
allocating the KV cache is not timed (the engine allocates its own when it is
built).  Each function returns one `RequestOutput` per request, in order, and
`latency_report` of the run.
"""
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from vattn.bench.hf import StepClock
from vattn.engine.metrics import latency_report
from vattn.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from vattn.llm import _progress
from vattn.sampling_params import SamplingParams


def serve_continuous_batching(model, prompts: list[list[int]], params: list[SamplingParams], *,
                              max_batch_tokens: int = 256, block_size: int = 256,
                              progress: bool = True) -> tuple[list[RequestOutput], dict]:
    """transformers' continuous batching, made fair on a CPU: without flash
    attention it attends over the whole flat batch at once (a mask keeps the
    requests apart), so a step costs the square of its tokens, and its default
    of 8192 tokens a step prefills every prompt in one huge forward; its
    default cache is sized from system RAM, here to what the requests need.
    Token times are the ones transformers records (`record_timestamps`) as it
    appends each token to its request, just before streaming it out."""
    eos = _check(model, prompts, params)
    num_blocks = sum(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params))
    config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    attention = model.config._attn_implementation
    results = {}
    try:
        with (model.continuous_batching_context_manager(GenerationConfig(do_sample=False, eos_token_id=eos or -1),
                                                        continuous_batching_config=config) as manager,
              _progress(len(prompts), progress) as advance):
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=sp.max_tokens, eos_token_id=eos, streaming=True,
                                       record_timestamps=True) for p, sp in zip(prompts, params)]
            if None in ids:
                raise RuntimeError("transformers' continuous batching refused a request")
            index = {request_id: i for i, request_id in enumerate(ids)}
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped before every request was done")
                elif result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                    i = index[result.request_id]
                    results[i] = _output(i, prompts[i], result.generated_tokens, eos, start, result.timestamps,
                                         time.perf_counter())
                    advance(results[i])
            seconds = time.perf_counter() - start
    finally:
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    outputs = [results[i] for i in range(len(prompts))]
    return outputs, latency_report(outputs, seconds)


class _RowLimits(StoppingCriteria):
    """Ends each row at its own `max_tokens` (generate's `max_new_tokens` is the batch's)."""

    def __init__(self, prompt_len: int, limits: list[int]):
        self.prompt_len, self.limits = prompt_len, torch.tensor(limits)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.prompt_len >= self.limits


def serve_static(model, prompts: list[list[int]], params: list[SamplingParams], *, batch_size: int = 8,
                 progress: bool = True) -> tuple[list[RequestOutput], dict]:
    """`model.generate` over batches of `batch_size` requests in arrival order,
    left-padded, with the model's own attention.  A row's tokens are timed as
    the batch's steps produce them; its result is available when the batch's
    generate() returns."""
    eos = _check(model, prompts, params)
    pad = next(t for t in (model.generation_config.pad_token_id, *eos, 0) if t is not None)
    outputs = []
    with _progress(len(prompts), progress) as advance, torch.inference_mode():
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            rows = range(first, min(first + batch_size, len(prompts)))
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
            limits = [params[i].max_tokens for i in rows]
            clock = StepClock()  # times[0]: the prompt; times[j + 1]: the batch's token j
            generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(limits),
                                       eos_token_id=eos or None, pad_token_id=pad, streamer=clock,
                                       stopping_criteria=StoppingCriteriaList([_RowLimits(width, limits)]))
            finish = time.perf_counter()
            for row, i in enumerate(rows):
                tokens = _until_eos(generated[row, width:width + limits[row]].tolist(), eos)
                outputs.append(_output(i, prompts[i], tokens, eos, start, clock.times[1:len(tokens) + 1], finish))
                advance(outputs[-1])
        seconds = time.perf_counter() - start
    return outputs, latency_report(outputs, seconds)


def _check(model, prompts, params) -> list[int]:
    """The model's eos ids, once the requests are known to be ones both peers serve as the engine would."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    if not all(prompts):
        raise ValueError("a prompt is empty")
    for p in params:
        if not p.greedy or p.n != 1 or p.stop or p.stop_token_ids or p.ignore_eos:
            raise ValueError(f"only greedy requests (n=1, stopping at eos or max_tokens) are served here, got {p}")
    ids = model.generation_config.eos_token_id
    return sorted(set(ids if isinstance(ids, list) else [] if ids is None else [ids]))


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    return next((tokens[:j + 1] for j, t in enumerate(tokens) if t in eos), tokens)


def _output(i, prompt, tokens, eos, arrival, token_times, finish) -> RequestOutput:
    reason = "stop" if tokens[-1] in eos else "length"
    metrics = RequestMetrics(arrival, token_times[0], finish, list(token_times), len(prompt), 0)
    return RequestOutput(str(i), None, prompt, [CompletionOutput(0, "", list(tokens), reason)], True, metrics)
