"""`vattn bench memory`: how much of a KV memory budget each policy keeps live,
replaying a request trace without a model.

Paged and virtual policies run the engine itself (scheduler, preemption,
mapping worker, the real allocators) driven by `TraceModel`, which computes
nothing: `VirtualKVCache` maps pages through the VMM backend without touching
them and `PagedKVCache` keeps block tables, so production-size budgets fit.
Static policies (Orca) are replayed by the same rules (iteration-level, FCFS,
the same token budget per step) with each request reserving one contiguous
range when admitted: `max_seq_len` tokens (Orca-Max), the next power of two of
its real length (Orca-Pow2), or its real length (Orca-Oracle); a request waits
until a free range fits it (first fit).

Per step, over the running requests (PagedAttention's definitions):
- live: bytes of the tokens they hold;
- committed: memory set aside for them (reservations, blocks, mapped pages;
  pages of idle slots are a cache reclaimed on demand, not counted);
- reserved: committed bytes for tokens they will still produce; internal:
  committed past a request's final length; external: free bytes left in
  holes between reservations once the step's admissions are done, while
  requests wait (static policies only: any free block or page fits).
Utilization is Σ live / Σ committed over the steps; waste shares are of
Σ (committed + external).
"""
import gc
import math
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vattn.bench.shapes import LLAMA_3_8B, LLAMA_3_70B_TP8, SMOLLM2_135M, Shape
from vattn.report import console, print_table, write_json

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    budget: int  # default KV budget: small enough that memory, not slots, bounds the batch
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def of(cls, shape: Shape, budget: int) -> "Geometry":
        return cls(shape.layers, shape.kv_heads, shape.head_dim, budget)

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


MODELS = {
    "smollm2-135m": Geometry.of(SMOLLM2_135M, 1 * GiB),
    "llama-3-8b": Geometry.of(LLAMA_3_8B, 4 * GiB),
    "llama-3-70b-tp8": Geometry.of(LLAMA_3_70B_TP8, 3 * GiB),
}
PAGE_SIZES = {"64k": 64 * KiB, "256k": 256 * KiB, "2m": 2 * MiB}
STATIC = ("orca_max", "orca_pow2", "orca_oracle")
POLICIES = STATIC + ("paged_16", "paged_32", "paged_256") + tuple(
    f"vattn_{layout}_{page}{suffix}" for layout in ("per_layer", "interleaved") for page in PAGE_SIZES
    for suffix in ("", "_nodefer"))

Trace = list[tuple[int, int]]  # (prompt tokens, output tokens) per request, all arriving at once


def sharegpt_trace(num: int, seed: int = 0) -> Trace:
    """Real ShareGPT conversations by vLLM's sampling rules (SmolLM2's tokenizer)."""
    from vattn import sharegpt
    from vattn.models import load_model

    _, tokenizer = load_model()
    return [(r.prompt_len, r.output_len) for r in sharegpt.sample(tokenizer, num, seed=seed)]


def alpaca_trace(num: int, seed: int = 0) -> Trace:
    """Short requests shaped like Alpaca's: log-normal lengths with means 19 (prompt) and 58 (output)."""
    rng = random.Random(seed)

    def length(mean, sigma=0.7):  # the log-normal whose mean is `mean`
        return max(4, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    return [(length(19), length(58)) for _ in range(num)]


TRACES = {"sharegpt": sharegpt_trace, "alpaca": alpaca_trace}


@dataclass(slots=True)
class Tally:
    """Byte sums over the steps of one replay."""

    live: int = 0
    committed: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0
    steps: int = 0
    completed: int = 0  # requests finished
    peak_concurrency: int = 0
    timeline: list[float] = field(default_factory=list)  # utilization per step

    def step(self, running: list[tuple[int, int, int]], external: int = 0) -> None:
        """`running`: (live, committed, final) bytes of each running request."""
        live = sum(r[0] for r in running)
        committed = sum(r[1] for r in running)
        reserved = sum(max(0, min(c, f) - v) for v, c, f in running)
        assert live <= committed, f"{live} bytes live in {committed} committed"
        self.live += live
        self.committed += committed
        self.reserved += reserved
        self.internal += committed - live - reserved
        self.external += external
        self.steps += 1
        self.peak_concurrency = max(self.peak_concurrency, len(running))
        self.timeline.append(live / committed if committed else 0.0)

    def row(self, **extra) -> dict:
        occupied = self.committed + self.external
        return extra | {
            "utilization": self.live / self.committed if self.committed else 0.0,
            "peak_concurrency": self.peak_concurrency, "steps": self.steps, "completed": self.completed,
            "waste": {k: getattr(self, k) / occupied if occupied else 0.0
                      for k in ("reserved", "internal", "external")},
        }


# ------------------------------------------------------------------ static reservations

def reservation(policy: str, tokens: int, max_seq_len: int) -> int:
    """Tokens a static policy reserves for a request whose real length is `tokens`."""
    if policy == "orca_max":
        return max_seq_len
    if policy == "orca_pow2":
        return min(max_seq_len, 1 << (tokens - 1).bit_length())
    return tokens


@dataclass(slots=True)
class _Reservation:
    prompt: int
    output: int
    start: int  # bytes of the arena it holds
    end: int
    tokens: int = 0  # the prompt and the tokens sampled so far
    computed: int = 0  # tokens whose KV is stored


def replay_static(policy: str, trace: Trace, token_bytes: int, budget: int, max_num_seqs: int,
                  max_num_batched_tokens: int, max_seq_len: int) -> Tally:
    waiting = list(trace)
    running: list[_Reservation] = []
    tally = Tally()
    while waiting or running:
        budget_tokens = max_num_batched_tokens
        work = []
        for r in running:  # running requests first, as the engine schedules them
            n = min(r.tokens - r.computed, budget_tokens)
            if n:
                work.append((r, n))
                budget_tokens -= n
        while waiting and budget_tokens and len(running) < max_num_seqs:
            prompt, output = waiting[0]
            size = reservation(policy, prompt + output, max_seq_len) * token_bytes
            start = first_fit([(r.start, r.end) for r in running], size, budget)
            if start is None:
                if not running:
                    raise ValueError(f"request {len(trace) - len(waiting)} reserves {size} bytes; "
                                     f"the budget holds {budget}")
                break
            waiting.pop(0)
            running.append(r := _Reservation(prompt, output, start, start + size, tokens=prompt))
            work.append((r, min(prompt, budget_tokens)))
            budget_tokens -= work[-1][1]
        holes = max((r.end for r in running), default=0) - sum(r.end - r.start for r in running)
        for r, n in work:
            r.computed += n
            if r.computed == r.tokens:
                r.tokens += 1  # a token is sampled
        done = [r for r in running if r.tokens - r.prompt == r.output]
        running = [r for r in running if r not in done]
        tally.completed += len(done)
        tally.step([(r.computed * token_bytes, r.end - r.start, (r.prompt + r.output) * token_bytes) for r in running],
                   external=holes if waiting else 0)
    return tally


def first_fit(taken: list[tuple[int, int]], size: int, budget: int) -> int | None:
    """The lowest start of `size` free bytes among the `taken` ranges, if any."""
    start = 0
    for lo, hi in sorted(taken):
        if lo - start >= size:
            return start
        start = hi
    return start if budget - start >= size else None


# ------------------------------------------------------------------ the engine on real allocators

class TraceModel:
    """A causal LM with a real model's KV geometry that computes nothing.  The
    engine schedules, maps, preempts and finishes requests as it would with the
    real model; every sampled token is 0 (requests ignore EOS and stop at their
    trace length)."""

    def __init__(self, geometry: Geometry):
        from transformers import LlamaConfig

        g = geometry
        self.config = LlamaConfig(vocab_size=1, num_hidden_layers=g.layers, num_key_value_heads=g.kv_heads,
                                  head_dim=g.head_dim, num_attention_heads=g.kv_heads,
                                  hidden_size=g.kv_heads * g.head_dim, bos_token_id=None, eos_token_id=None)
        self.dtype, self.device, self.generation_config = g.dtype, torch.device("cpu"), None

    def eval(self):
        return self

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name

    def __call__(self, logits_to_keep: torch.Tensor, **inputs):
        return SimpleNamespace(logits=torch.zeros(1, len(logits_to_keep), 1))


def engine_settings(policy: str) -> dict:
    """EngineConfig settings of a paged or virtual policy name."""
    if policy.startswith("paged_"):
        return dict(kv_cache="paged", block_size=int(policy.removeprefix("paged_")))
    _, *layout, page = policy.removesuffix("_nodefer").split("_")
    return dict(layout="_".join(layout), page_size=PAGE_SIZES[page], deferred_reclamation=not policy.endswith("_nodefer"))


def replay_engine(policy: str, trace: Trace, geometry: Geometry, budget: int, max_num_seqs: int,
                  max_num_batched_tokens: int, max_seq_len: int) -> tuple[Tally, dict]:
    from vattn.engine import LLMEngine
    from vattn.sampling_params import SamplingParams

    engine = LLMEngine(TraceModel(geometry), max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       max_seq_len=max_seq_len, memory_budget=budget, enable_prefix_caching=False,
                       pack_linears=False, fuse_projections=False, **engine_settings(policy))  # it has no linears
    try:
        final = {}
        for prompt, output in trace:
            rid = engine.add_request([0] * prompt, SamplingParams(max_tokens=output, temperature=0, ignore_eos=True))
            final[rid] = (prompt + output) * geometry.token_bytes
        tally, cache, page = Tally(), engine.kv.cache, engine.kv.config.page_bytes
        while engine.has_unfinished_requests():
            tally.completed += sum(o.finished for o in engine.step())
            tally.step([(seq.num_computed_tokens * geometry.token_bytes, cache.mapped_pages(engine.kv.slot(seq)) * page,
                         final[req.request_id]) for req in engine.scheduler.running for seq in req.live_seqs])
        counters = {"map_calls": cache.map_calls, "preemptions": engine.stats.preemptions,
                    "map_limit_hits": engine.stats.map_limit_hits}
    finally:
        engine.close()
        del engine
        gc.collect()  # unmap this policy's reservation before the next one maps
    return tally, counters


# ------------------------------------------------------------------ the bench

def replay(policy: str, trace: Trace, geometry: Geometry, budget: int, max_num_seqs: int = 256,
           max_num_batched_tokens: int = 2048, max_seq_len: int = 2048) -> tuple[Tally, dict]:
    """(tally, counters) of one policy on one trace."""
    longest = max(range(len(trace)), key=lambda i: sum(trace[i]))
    if sum(trace[longest]) > max_seq_len:
        raise ValueError(f"request {longest} needs {sum(trace[longest])} tokens; max_seq_len is {max_seq_len}")
    limits = (max_num_seqs, max_num_batched_tokens, max_seq_len)
    if policy in STATIC:
        counters = {"map_calls": 0, "preemptions": 0, "map_limit_hits": 0}
        return replay_static(policy, trace, geometry.token_bytes, budget, *limits), counters
    return replay_engine(policy, trace, geometry, budget, *limits)


def run(json_path: str | None, plot_dir: str | None, traces: list[str], models: list[str], num_requests: int,
        budget: int | None = None, policies: tuple[str, ...] = POLICIES) -> dict:
    from rich.progress import Progress

    rows, timelines = [], {}
    loaded = {name: TRACES[name](num_requests) for name in traces}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=len(traces) * len(models) * len(policies))
        for trace_name, trace in loaded.items():
            for model in models:
                geometry = MODELS[model]
                for policy in policies:
                    progress.update(task, description=f"{trace_name} · {model} · {policy}")
                    start = time.perf_counter()
                    tally, counters = replay(policy, trace, geometry, budget or geometry.budget)
                    rows.append(tally.row(policy=policy, trace=trace_name, model=model) | counters | {
                        "budget_bytes": budget or geometry.budget, "seconds": time.perf_counter() - start})
                    timelines[trace_name, model, policy] = tally.timeline
                    progress.advance(task)
    _print(rows)
    result = {"rows": rows, "requests": num_requests,
              "trace_means": {name: [sum(r[i] for r in t) / len(t) for i in (0, 1)] for name, t in loaded.items()},
              "targets": targets(rows)}
    write_json(json_path, result)
    if plot_dir:
        _plot(plot_dir, timelines)
    return result


def targets(rows: list[dict]) -> dict:
    """The figures the project aims at: ShareGPT on Llama-3-8B, vattn interleaved 2 MiB."""
    by = {r["policy"]: r for r in rows if r["trace"] == "sharegpt" and r["model"] == "llama-3-8b"}
    v, paged, orca = by.get("vattn_interleaved_2m"), by.get("paged_16"), by.get("orca_max")
    if not (v and paged and orca):
        return {}
    return {"utilization": v["utilization"],
            "peak_concurrency_vs_paged_16": v["peak_concurrency"] / paged["peak_concurrency"],
            "peak_concurrency_vs_orca_max": v["peak_concurrency"] / orca["peak_concurrency"]}


def _print(rows: list[dict]) -> None:
    for (trace, model) in dict.fromkeys((r["trace"], r["model"]) for r in rows):
        print_table(f"memory: {trace} on {model}", ["policy", "utilization", "reserved", "internal", "external",
                                                    "peak concurrent", "steps", "map calls", "preemptions"],
                    [[r["policy"], f"{r['utilization']:.1%}", *(f"{r['waste'][k]:.1%}" for k in r["waste"]),
                      r["peak_concurrency"], r["steps"], r["map_calls"], r["preemptions"]]
                     for r in rows if (r["trace"], r["model"]) == (trace, model)])


def _plot(plot_dir: str, timelines: dict) -> None:
    from pathlib import Path

    from vattn.bench.plots import line_chart

    for (trace, model) in dict.fromkeys(k[:2] for k in timelines):
        series = {policy: (list(range(1, len(t) + 1)), t) for (tr, m, policy), t in timelines.items()
                  if (tr, m) == (trace, model) and not policy.endswith("_nodefer")}
        line_chart(Path(plot_dir) / f"memory_{trace}_{model}.png", f"KV utilization over time: {trace}, {model}",
                   "step", "live / committed", series)
