"""The serving engine: requests in, tokens out, one scheduler step at a time.

A step is: the scheduler's plan (`schedule`), the forward prepared
(`ModelRunner.prepare`), the pages the next step needs mapped in the
background, the forward run (`ModelRunner.run`), then, request by request,
the scheduler's bookkeeping (`update`), sampling and stop checks, and the
finished sequences let go.  The engine reaches the cache only through its
manager (`KVCacheManager`); the runner holds its data plane.  What fails in
one request's part ends that request with an error (`RequestOutput.error`),
all it held freed, and nothing else.
"""
import atexit
import functools
import gc
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vattn import dtypes
from vattn.checks import is_int
from vattn.distributed.group import Group, Message, RankFailed
from vattn.distributed.lockstep import RecordingKV, checked_books
from vattn.engine.config import EngineConfig
from vattn.engine.map_worker import MapWorker
from vattn.engine.metrics import EngineStats
from vattn.engine.plan import StepPlan
from vattn.engine.request import CompletionOutput, Request, RequestMetrics, RequestOutput, Sequence
import vattn.engine.sampler as sampler
from vattn.engine.scheduler import Scheduler
from vattn.executor.inputs import StepInputs
from vattn.executor.runner import ModelRunner
from vattn.kv import KVCacheManager, make_cache
from vattn.sampling_params import SamplingParams


UNHEALTHY_AFTER = 3  # forwards failing in a row


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, group: Group | None = None,
                 **settings):
        """`model`: a transformers causal LM (its attention implementation is
        switched to vattn's until `close`); `tokenizer` for text prompts, stop
        strings and output text; settings: `EngineConfig` fields.  With
        `group` (rank 0 of `vattn.distributed.ranks.launch`), `model` is this
        rank's shard and every step is broadcast to the other ranks."""
        self.config = config = (config or EngineConfig(**settings)).for_model(model)
        dtypes.check_model(config.dtype, model)
        if (config.tensor_parallel_size > 1) != (group is not None):
            raise ValueError("tensor_parallel_size > 1 runs through vattn.LLM, which starts the ranks")
        cache = make_cache(config.cache_config(model), config.kv_cache, config.block_size, config.kv_pool)
        kv = KVCacheManager(cache, config.enable_prefix_caching)
        self.group = group
        self.kv = kv if group is None else RecordingKV(kv)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(model, cache, config.runner_options(sharded=group is not None))
        self.model, self.tokenizer = model, tokenizer
        self.worker = MapWorker() if config.map_ahead else None
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(self.scheduler, self.kv, self.worker, self.runner)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self._vocab = model.config.get_text_config().vocab_size
        self._ids = itertools.count()
        self._failed_forwards = 0  # in a row
        _freeze_heap()

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        """Queue a request (text, or token ids); returns its id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self.requests)
        request_id = str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        text, ids = self._tokenize(prompt)
        limit = self.config.max_seq_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_seq_len={limit} leaves no room for output")
        if params.n > min(self.config.max_num_seqs, self.config.max_num_batched_tokens):
            raise ValueError(f"n={params.n} samples need {params.n} slots and tokens per step; the engine runs "
                             f"max_num_seqs={self.config.max_num_seqs}, max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        # every sample at its longest, each in its own pages (shared prompt pages stop being shared
        # when a preempted request comes back), must fit, or the request could never finish
        need = params.n * self.kv.pages_for(min(len(ids) + params.max_tokens, limit))
        if need > self.kv.num_pages:
            raise ValueError(f"the request may need {need} pages; the memory budget holds {self.kv.num_pages}")
        req = Request(request_id, text, ids, params, cache_salt)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its pages go back (idle, for reuse)."""
        req = self.requests.get(str(request_id))
        if req is None:
            raise ValueError(f"no request {request_id!r} in the engine (unknown, or already finished)")
        self._wait_for_mapping()
        self.scheduler.abort(req)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def stream(self) -> Iterator[RequestOutput]:
        """Run until every request is done, yielding each request's output
        whenever it has new tokens (`CompletionOutput.new_token_ids`)."""
        while self.has_unfinished_requests():
            yield from self.step()

    # ------------------------------------------------------------ a step

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs of requests with new
        tokens, and of those that ended in error.  What goes wrong for one
        request (its admission, sampling, a logits processor, stop strings)
        ends that request alone; an exception from the forward is raised
        with nothing changed, and three in a row make the engine unhealthy."""
        start = time.perf_counter()
        mapped_before = self.scheduler.map_seconds
        plan = self.scheduler.schedule()
        outputs = [self._fail(req, e) for req, e in plan.failed]
        if not plan.work:
            stuck = self.scheduler.has_unfinished and not plan.preempted and not plan.failed
            if stuck and not self.kv.others_hold_memory():  # in a shared pool the others may let memory go
                why = " (the process is at vm.max_map_count)" if self.kv.map_limit_hits else ""
                raise RuntimeError(f"no request could be scheduled: memory is too short{why}")
            return outputs
        logits, waited = self._forward(plan)
        usage, pages = self.kv.usage, self.kv.num_mapped_pages
        outputs += self._advance(plan, logits)
        self.stats.record(time.perf_counter() - start, self.scheduler.map_seconds - mapped_before + waited,
                          plan.num_tokens, usage, pages, not plan.chunks)
        return outputs

    @property
    def is_healthy(self) -> bool:
        """False after three forwards in a row failed, or once the tensor-parallel ranks are down."""
        return self._failed_forwards < UNHEALTHY_AFTER and not (self.group is not None and self.group.closed)

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, float]:
        """(the logits of the rows that sample, the seconds spent on mapping
        the step's critical path waited for: the mapping worker, and a range
        the forward reads whole made readable)."""
        try:
            inputs = plan.inputs()
            step = self.runner.prepare(inputs)
            self._map_ahead(plan, background=not step.pins_pages)
            try:
                with self._ranks():
                    self._broadcast(inputs)
                    logits = self.runner.run(step)
            finally:
                waited = self._wait_for_mapping() + step.fill_seconds
        except Exception:
            self._failed_forwards += 1
            raise
        self._failed_forwards = 0
        return logits, waited

    def _map_ahead(self, plan: StepPlan, background: bool) -> None:
        """The next step's pages (`Scheduler.map_ahead`): on the worker while
        this step computes, or here and now without one or when the forward
        reads a range the worker could change."""
        if self.worker and background:
            self.worker.submit(lambda: self.scheduler.map_ahead(plan))
        else:
            self.scheduler.timed(self.scheduler.map_ahead, plan)

    def _wait_for_mapping(self) -> float:
        return self.worker.wait() if self.worker else 0.0

    # ------------------------------------------------------------ tensor parallelism

    def _broadcast(self, inputs: StepInputs) -> None:
        """The step to the other ranks: the cache calls since the last, and the forward."""
        if self.group is not None:
            start = time.perf_counter()
            self.group.send(Message(self.kv.take(), inputs))
            self.stats.broadcast_seconds += time.perf_counter() - start

    @contextmanager
    def _ranks(self):
        """Around what the other ranks take part in: a failure anywhere ends
        the group (no rank is left waiting) and names the rank that failed."""
        if self.group is None:
            yield
            return
        if self.group.closed:
            raise RankFailed("the tensor-parallel ranks are shut down; this engine can serve no more")
        try:
            yield
        except BaseException as e:
            raise self.group.failure(e) from e

    def rank_books(self) -> list[tuple]:
        """Every rank's page books (`vattn.distributed.lockstep.checked_books`),
        each rank's cache checked first; under tensor parallelism all must be
        equal."""
        self._wait_for_mapping()
        if self.group is None:
            return [checked_books(self.kv)]
        with self._ranks():
            self.group.send(Message(self.kv.take(), query="books"))
            return self.group.gather(checked_books(self.kv.kv))

    def _advance(self, plan: StepPlan, logits: torch.Tensor) -> list[RequestOutput]:
        """Each request's part of the step after the forward: the scheduler's
        bookkeeping, a token for each of its sampling sequences, stop checks.
        An exception in a request's part ends that request, and no other."""
        now, outputs = time.perf_counter(), []
        # every row's greedy token, in one call: max's indices (the first maximum, as argmax's), 2-4x argmax's speed
        greedy = functools.cache(lambda: logits.max(-1).indices.tolist())
        for req, work in plan.by_request().items():
            try:
                rows, new = dict(work), {}
                for seq, parent in self.scheduler.update(req, list(rows)):
                    row, p = rows[parent], req.params
                    token = greedy()[row] if p.greedy and not p.shapes_logits else sampler.sample(
                        logits[row], p, seq.generator, seq.token_ids, seq.prompt_len,
                        () if p.ignore_eos else self.eos_token_ids)
                    if p.logprobs is not None:
                        seq.logprobs.append(sampler.logprobs(logits[row], token, p.logprobs))
                    seq.token_ids.append(token)
                    new[seq.index] = token
                    self._check_stop(req, seq)
                if new:
                    outputs.append(self._emit(req, new, now))
            except Exception as e:
                self.scheduler.abort(req, error=True)
                outputs.append(self._fail(req, e))
        return outputs

    def _emit(self, req: Request, new: dict[int, int], now: float) -> RequestOutput:
        """The output of a request that sampled `new` tokens (by sample index) this step."""
        req.token_times.append(now)
        for s in req.seqs:
            if s.index in new and s.finished:
                self.scheduler.finish(req, s)
        if req.finished:
            req.finish_time = now
            del self.requests[req.request_id]
        return self._output(req, new)

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """The output of a request the scheduler ended in error, saying why."""
        req.error = f"{type(error).__name__}: {error}"
        for s in req.seqs:
            if not s.finished:
                s.finish_reason = "error"
        req.finish_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        return self._output(req, {})

    def _check_stop(self, req: Request, seq: Sequence) -> None:
        p, token = req.params, seq.token_ids[-1]
        may_stop = len(seq.output_ids) > p.min_tokens  # vLLM: stop strings count only past min_tokens too
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = "stop"
        elif may_stop and p.stop and (cut := _stop_cut(_text(self.tokenizer, seq.output_ids), p.stop)) is not None:
            seq.finish_reason, seq.stop_at = "stop", cut
        elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.config.max_seq_len:
            seq.finish_reason = "length"

    def _output(self, req: Request, new: dict[int, int]) -> RequestOutput:
        completions = [CompletionOutput(s.index, functools.partial(_text, self.tokenizer, ids, s.stop_at), ids,
                                        s.finish_reason, [new[s.index]] if s.index in new else [],
                                        list(s.logprobs) if req.params.logprobs is not None else None)
                       for s in req.seqs for ids in [s.output_ids]]
        first_token = req.token_times[0] if req.token_times else None  # None: it ended in error before any
        metrics = RequestMetrics(req.arrival_time, first_token, req.finish_time, req.token_times,
                                 len(req.prompt_token_ids), req.num_cached_tokens, req.scheduled_time)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, req.finished, metrics,
                             req.error)

    # ------------------------------------------------------------ text

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer(prompt)["input_ids"]
            text = prompt
        else:
            ids, text = list(prompt), None
            if not all(is_int(t) and 0 <= t < self._vocab for t in ids):
                raise ValueError(f"prompt token ids must be ints in [0, {self._vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        return text, ids

    def close(self) -> None:
        """Stop the mapping thread, give the collector back the objects the
        engine's start froze, give back the memory idle slots hold, give the
        model its own linears and attention back, and stop the other
        tensor-parallel ranks."""
        if self.worker:
            self.worker.close()
        gc.unfreeze()
        self.scheduler.trim()
        self.runner.close()
        if self.group is not None and not self.group.closed:
            try:
                with self._ranks():
                    self.group.send(Message(self.kv.take(), query="stop"))
            finally:
                self.group.shutdown()
                self.model = self.runner.model = None  # its gloo groups end now, not in the interpreter's exit
                gc.collect()


def _freeze_heap() -> None:
    """Leave every object alive now (the model, its tokenizer, the libraries:
    some 400,000 with SmolLM2) out of the collector's passes while the engine
    serves, as vLLM's engine does: a full pass over them took 0.18 s, several
    times a run.  `close`, or the process's exit, gives them back."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def _text(tokenizer, ids: list[int], stop_at: int | None = None) -> str:
    """The text of `ids`, its first `stop_at` characters (None: all)."""
    return tokenizer.decode(ids, skip_special_tokens=True)[:stop_at] if tokenizer is not None else ""


def _stop_cut(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts in `text`, if any."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
