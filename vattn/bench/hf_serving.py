"""The peers vattn's engine is compared against end to end, serving the same
requests and reporting the same figures: transformers' own continuous batching
(paged cache) and `model.generate` over static batches (DynamicCache).

Requests are greedy and stop at `max_tokens` or at the model's eos (kept in
the output; with `ignore_eos` only at `max_tokens`), as in the engine.
Request i arrives `arrivals[i]` seconds after the clock starts (by default
all at once); a request's arrival time is when it was due, even if the server
was busy then.  Allocating the KV cache is not timed (the engine allocates
its own when it is built).  Each function returns one `RequestOutput` per
request, in order, and `latency_report` of the run with the KV bytes its
cache held at most (`kv_bytes_committed`).
"""
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from vattn.bench.hf import StepClock
from vattn.engine.metrics import latency_report
from vattn.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from vattn.llm import progress_bar
from vattn.sampling_params import SamplingParams


def serve_continuous_batching(model, prompts: list[list[int]], params: list[SamplingParams], *,
                              arrivals: list[float] | None = None, num_blocks: int | None = None,
                              max_batch_tokens: int = 256, block_size: int = 256,
                              progress: bool = True) -> tuple[list[RequestOutput], dict]:
    """transformers' continuous batching, made fair on a CPU: without flash
    attention it attends over the whole flat batch at once (a mask keeps the
    requests apart), so a step costs the square of its tokens, and its default
    of 8192 tokens a step prefills every prompt in one huge forward.  Its
    default cache is sized from system RAM; `num_blocks` of `block_size`
    tokens sets it (default: what the requests need).  Token times are the
    ones transformers records (`record_timestamps`) as it appends each token
    to its request, just before streaming it out."""
    eos, arrivals = _check(model, prompts, params, arrivals)
    if num_blocks is None:
        num_blocks = sum(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in zip(prompts, params))
    config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    attention = model.config._attn_implementation
    results, order = {}, sorted(range(len(prompts)), key=arrivals.__getitem__)
    try:
        with (model.continuous_batching_context_manager(GenerationConfig(do_sample=False, eos_token_id=eos or -1),
                                                        continuous_batching_config=config) as manager,
              progress_bar(len(prompts), progress) as advance):
            start, index = time.perf_counter(), {}
            while len(results) < len(prompts):
                now = time.perf_counter() - start
                while len(index) < len(order) and arrivals[order[len(index)]] <= now:
                    i = order[len(index)]
                    request_id = manager.add_request(prompts[i], max_new_tokens=params[i].max_tokens,
                                                     eos_token_id=-1 if params[i].ignore_eos else eos,
                                                     streaming=True, record_timestamps=True)
                    if request_id is None:
                        raise RuntimeError("transformers' continuous batching refused a request")
                    index[request_id] = i
                wait = arrivals[order[len(index)]] - now if len(index) < len(order) else 1.0
                result = manager.get_result(timeout=max(1e-3, min(wait, 1.0)))
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped before every request was done")
                elif result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
                    i = index[result.request_id]
                    results[i] = _output(i, prompts[i], result.generated_tokens, eos, start + arrivals[i],
                                         result.timestamps, time.perf_counter())
                    advance(results[i])
            seconds = time.perf_counter() - start
    finally:
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
    outputs = [results[i] for i in range(len(prompts))]
    held = num_blocks * block_size * _token_bytes(model)
    return outputs, latency_report(outputs, seconds) | {"kv_bytes_committed": held}


class _RowLimits(StoppingCriteria):
    """Ends each row at its own `max_tokens` (generate's `max_new_tokens` is the batch's)."""

    def __init__(self, prompt_len: int, limits: list[int]):
        self.prompt_len, self.limits = prompt_len, torch.tensor(limits)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] - self.prompt_len >= self.limits


def serve_static(model, prompts: list[list[int]], params: list[SamplingParams], *, batch_size: int = 8,
                 arrivals: list[float] | None = None, progress: bool = True) -> tuple[list[RequestOutput], dict]:
    """`model.generate` over static batches, left-padded, with the model's own
    attention: each batch takes the `batch_size` shortest prompts among the
    requests that have arrived (waiting for one when none has), so that
    requests arriving at once run sorted by length.  A row's tokens are timed
    as the batch's steps produce them; its result is available when the
    batch's generate() returns."""
    eos, arrivals = _check(model, prompts, params, arrivals)
    pad = next(t for t in (model.generation_config.pad_token_id, *eos, 0) if t is not None)
    outputs, pending, held = [], set(range(len(prompts))), 0
    with progress_bar(len(prompts), progress) as advance, torch.inference_mode():
        start = time.perf_counter()
        while pending:
            time.sleep(max(0.0, min(arrivals[i] for i in pending) - (time.perf_counter() - start)))
            now = time.perf_counter() - start
            rows = sorted((i for i in pending if arrivals[i] <= now), key=lambda i: (len(prompts[i]), i))[:batch_size]
            pending -= set(rows)
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
            limits = [params[i].max_tokens for i in rows]
            held = max(held, len(rows) * (width + max(limits)) * _token_bytes(model))  # DynamicCache at its longest
            clock = StepClock()  # times[0]: the prompt; times[j + 1]: the batch's token j
            generated = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max(limits),
                                       eos_token_id=None if params[0].ignore_eos else eos or None, pad_token_id=pad,
                                       streamer=clock,
                                       stopping_criteria=StoppingCriteriaList([_RowLimits(width, limits)]))
            finish = time.perf_counter()
            for row, i in enumerate(rows):
                tokens = generated[row, width:width + limits[row]].tolist()
                tokens = tokens if params[i].ignore_eos else _until_eos(tokens, eos)
                outputs.append(_output(i, prompts[i], tokens, eos, start + arrivals[i], clock.times[1:len(tokens) + 1],
                                       finish))
                advance(outputs[-1])
        seconds = time.perf_counter() - start
    outputs.sort(key=lambda o: int(o.request_id))
    return outputs, latency_report(outputs, seconds) | {"kv_bytes_committed": held}


def _check(model, prompts, params, arrivals) -> tuple[list[int], list[float]]:
    """The model's eos ids and the arrivals, once the requests are known to be
    ones both peers serve as the engine would."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    arrivals = [0.0] * len(prompts) if arrivals is None else list(arrivals)
    if len(arrivals) != len(prompts) or any(not t >= 0 for t in arrivals):
        raise ValueError(f"arrivals must be one offset >= 0 per prompt, got {arrivals}")
    if not all(prompts):
        raise ValueError("a prompt is empty")
    for p in params:
        if not p.greedy or p.n != 1 or p.stop or p.stop_token_ids:
            raise ValueError(f"only greedy requests (n=1, stopping at eos or max_tokens) are served here, got {p}")
    if len({p.ignore_eos for p in params}) > 1:
        raise ValueError("the requests must agree on ignore_eos (a static batch stops at eos for all its rows or none)")
    ids = model.generation_config.eos_token_id
    return sorted(set(ids if isinstance(ids, list) else [] if ids is None else [ids])), arrivals


def _token_bytes(model) -> int:
    """Bytes of K and V one token takes across the model's layers."""
    from vattn.config import CacheConfig

    return CacheConfig.from_model(model).kv_bytes_per_token


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    return next((tokens[:j + 1] for j, t in enumerate(tokens) if t in eos), tokens)


def _output(i, prompt, tokens, eos, arrival, token_times, finish) -> RequestOutput:
    reason = "stop" if tokens[-1] in eos else "length"
    metrics = RequestMetrics(arrival, token_times[0], finish, list(token_times), len(prompt), 0)
    return RequestOutput(str(i), None, prompt, [CompletionOutput(0, "", list(tokens), reason)], True, metrics)
