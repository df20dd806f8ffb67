"""`vattn bench models`: three models behind one machine's servers, their
traffic peaking in turn, at several total KV budgets.

Three instances of one built-in model (SmolLM2), named m0, m1, m2, each get
their own ShareGPT requests (none shared, so no prefix is cached across
models) at a Poisson rate that ramps from idle to a peak and back: given
their number, the arrivals of a Poisson process of triangular intensity are
independent draws from the triangle, here of half-width `spacing` seconds,
model k's centred at (k + 1) · `spacing` — the peaks staggered, each
model's ramp overlapping its neighbours' (the shape of kvcached's
`bench_latency_benefit`).  Peaks 60 s apart keep the cores ahead of the
traffic (a 2-core Xeon serves it about two thirds busy), so what a request
waits for is memory: 40 s apart, every system queued for the cores and the
memory policy hardly showed.  Every request is streamed from
`/v1/completions`, greedy, EOS ignored, its answer as long as its
reference reply (at most `max_tokens`), by one asyncio client that times
each token as it arrives.

Systems, each with the same total KV budget, model, dtype, context and both
cores:
- `shared`: one `vattn serve` of the three, one KV pool;
- `static`: the same server with each model's floor and cap a third of the
  pool: three fixed partitions;
- `vllm`: one `vllm serve` per model, each with a third of the budget and
  every core (`peers.popen`: its OpenMP threads bound to all cores, as each
  of them would be on a machine of its own).

While a system runs, its `/metrics` are read twice a second: vattn's pool
bytes per model (held, mapped), vLLM's KV usage (of a third each; vLLM
reserves its third at start).  Peak PSS is sampled over every process of a
server, and summed over vLLM's three servers' peaks.  Each server answers
one short request per model before the timed run.  The systems take turns
within each of `rounds` rounds; each figure is its median over the rounds.
"""
import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from vattn.bench import e2e, scrape
from vattn.bench.report import median_figures
from vattn.bench.serve import Server
from vattn.engine.metrics import summary
from vattn.kv.shared import CHUNK_SIZE as CHUNK  # the pool's: a third of each budget is whole chunks
from vattn.report import console, machine, print_table, write_json

SYSTEMS = ("shared", "static", "vllm")
MODELS = ("m0", "m1", "m2")
BUDGETS = (576 << 20, 384 << 20, 288 << 20)  # a model at its peak wants more than a third, down to tight
QUICK = dict(num_requests=12, budgets=[288 << 20], spacing=6.0, max_tokens=16, rounds=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vattn.serve.sizes import byte_size

    p.add_argument("--budgets", type=byte_size, nargs="+", default=list(BUDGETS),
                   help="total KV budgets, each a multiple of 96MiB (default: 576MiB 384MiB 288MiB)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per model")
    p.add_argument("--spacing", type=float, default=60.0, help="seconds between the models' peaks")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each answer")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each figure their median")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to run")
    p.add_argument("--quick", action="store_true", help="a smaller run: 12 requests a model, 288MiB, peaks 6 s "
                                                        "apart, answers ≤ 16 tokens, one round")
    p.add_argument("--log-dir", help="where the servers' logs go (default: a temporary folder)")


def main(args: argparse.Namespace) -> dict:
    sizes = QUICK if args.quick else {}
    return run(args.json, args.plot, dtype=args.dtype, systems=args.systems, log_dir=args.log_dir,
               **{k: sizes.get(k, getattr(args, k))
                  for k in ("num_requests", "budgets", "spacing", "max_tokens", "rounds")})


def workload(tokenizer, num_requests: int, spacing: float, max_tokens: int, seed: int = 0) -> dict[str, list[dict]]:
    """Each model's requests (prompt ids, answer length, arrival in seconds), in arrival order."""
    from vattn import sharegpt

    sampled = sharegpt.sample(tokenizer, num_requests * len(MODELS), seed=seed)
    if len(sampled) < num_requests * len(MODELS):
        raise ValueError(f"ShareGPT holds {len(sampled)} requests that fit; {len(MODELS)} models need "
                         f"{num_requests * len(MODELS)}")
    rng = random.Random(seed)
    out = {}
    for k, model in enumerate(MODELS):
        centre = (k + 1) * spacing
        arrivals = sorted(rng.triangular(centre - spacing, centre + spacing, centre) for _ in range(num_requests))
        mine = sampled[k * num_requests:(k + 1) * num_requests]
        out[model] = [{"prompt": sharegpt.chat_prompt(tokenizer, r.prompt),
                       "max_tokens": max(1, min(max_tokens, r.output_len)), "arrival": t}
                      for r, t in zip(mine, arrivals)]
    return out


def run(json_path: str | None, plot_dir: str | None = None, dtype: str = "auto", systems=SYSTEMS,
        budgets=BUDGETS, num_requests: int = 100, spacing: float = 60.0, max_tokens: int = 64,
        rounds: int = 3, log_dir: str | None = None) -> dict:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    for budget in budgets:
        if budget % (len(MODELS) * CHUNK):
            raise ValueError(f"each budget must be a multiple of {len(MODELS) * CHUNK >> 20}MiB (a third of it whole "
                             f"chunks of {CHUNK >> 20}MiB), got {budget}")
    systems = [s for s in SYSTEMS if s in systems]
    loaded = e2e.load("smollm2", dtype)
    max_len = loaded.engine.max_seq_len
    reqs = workload(loaded.tokenizer, num_requests, spacing, max_tokens)
    log = Path(log_dir or tempfile.mkdtemp(prefix="vattn-bench-models-"))
    log.mkdir(parents=True, exist_ok=True)
    console.print(f"models: 3 × smollm2 in {loaded.dtype}, {num_requests} ShareGPT requests each, peaks {spacing:g} s "
                  f"apart, answers ≤ {max_tokens} tokens, budgets {[f'{b / 2**30:.2f} GiB' for b in budgets]}, "
                  f"{rounds} round(s); logs in {log}")
    runs = []
    for k in range(rounds):
        for budget in budgets:
            for system in systems:
                console.print(f"round {k + 1}/{rounds}: {system}, {budget / 2**30:.2f} GiB")
                runs.append({"round": k, **_run_one(system, loaded, max_len, budget, reqs, log / f"round{k}")})
    result = {"model": "smollm2", "dtype": loaded.dtype, **machine(), "models": list(MODELS),
              "num_requests_per_model": num_requests, "spacing_s": spacing, "max_tokens": max_tokens,
              "max_model_len": max_len, "budgets": list(budgets), "vllm_binding": "each server: every core",
              "rounds": rounds, "medians": medians(runs), "runs": runs}
    result["verdicts"] = verdicts(result)
    _print(result)
    write_json(json_path, result)
    if plot_dir:
        _plot(result, Path(plot_dir))
    return result


def _start(system: str, where: str, dtype: str, max_len: int, budget: int, log: Path) -> list[Server]:
    """The system's servers, up."""
    if system == "vllm":
        servers = [Server("vllm", where, m, dtype, max_len, budget // len(MODELS), log / f"vllm_{m}.log", wait=False)
                   for m in MODELS]
    else:
        flags = [f for m in MODELS for f in ("--model", f"{m}={where}")]
        if system == "static":
            third = budget // len(MODELS)
            flags += [f for m in MODELS for f in ("--kv-floor", f"{m}={third}", "--kv-cap", f"{m}={third}")]
        servers = [Server("vattn", None, None, dtype, max_len, budget, log / f"{system}.log", tuple(flags),
                          wait=False)]
    for server in servers:
        server.wait_ready()
    return servers


def _run_one(system: str, loaded, max_len: int, budget: int, reqs: dict[str, list[dict]], log: Path) -> dict:
    folder = log / f"{system}_{budget >> 20}MiB"
    folder.mkdir(parents=True, exist_ok=True)
    servers = _start(system, loaded.where, loaded.dtype, max_len, budget, folder)
    urls = {m: servers[k if system == "vllm" else 0].url for k, m in enumerate(MODELS)}
    try:
        asyncio.run(_drive(urls, {m: [{**r, "arrival": 0.0, "max_tokens": 2} for r in rs[:1]]
                                  for m, rs in reqs.items()}))  # a warm-up request each
        poller = scrape.Poller(system, urls, budget).start()
        start = time.time()
        results = asyncio.run(_drive(urls, reqs))
        poller.stop()
        preemptions = {m: scrape.preemptions(system, urls[m], m) for m in MODELS}
        memory = sum(s.peak_memory()["peak_pss_bytes"] for s in servers)
    finally:
        for s in servers:
            s.close()
    per_model = {m: figures([r for r in results if r["model"] == m]) for m in MODELS}
    return {"system": system, "budget": budget, "overall": figures(results), "per_model": per_model,
            "preemptions": preemptions, "peak_pss_bytes": memory, "kv_over_time": poller.samples,
            "started": start}


async def _drive(urls: dict[str, str], reqs: dict[str, list[dict]]) -> list[dict]:
    """Every model's requests, each sent at its arrival; what each measured."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(_send(client, urls[m], m, r, start) for m, rs in reqs.items() for r in rs))


async def _send(client, url: str, model: str, req: dict, start: float) -> dict:
    """One streamed completion: its TTFT, latency and tokens, or its error."""
    import httpx

    await asyncio.sleep(max(0.0, start + req["arrival"] - time.perf_counter()))
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, tokens, error = time.perf_counter(), None, 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                error = f"{answer.status_code}: {(await answer.aread())[:200]!r}"
            else:
                async for line in answer.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and first is None:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if "error" in chunk:
                        error = str(chunk["error"])
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and tokens != req["max_tokens"]:
        error = f"{tokens} of {req['max_tokens']} tokens"
    return {"model": model, "arrival": req["arrival"], "sent": sent - start,
            "ttft": None if first is None else first - sent, "latency": end - sent, "tokens": tokens, "error": error}


def figures(results: list[dict]) -> dict:
    """TTFT and TPOT (median, p99) in ms, output tok/s, requests completed."""
    done = [r for r in results if r["error"] is None]
    ttft = summary([r["ttft"] * 1e3 for r in done])
    tpot = summary([(r["latency"] - r["ttft"]) * 1e3 / (r["tokens"] - 1) for r in done if r["tokens"] > 1])
    span = max((r["sent"] + r["latency"] for r in results), default=0) - min((r["sent"] for r in results), default=0)
    return {"requests": len(results), "completed": len(done),
            "errors": sorted({r["error"] for r in results if r["error"]})[:3],
            "median_ttft_ms": ttft["median"], "p99_ttft_ms": ttft["p99"],
            "median_tpot_ms": tpot["median"], "p99_tpot_ms": tpot["p99"],
            "output_tok_per_s": sum(r["tokens"] for r in done) / span if span else 0.0}


def medians(runs: list[dict]) -> list[dict]:
    """Each system's figures at each budget, their medians over the rounds."""
    out = []
    for key in dict.fromkeys((r["system"], r["budget"]) for r in runs):
        mine = [r for r in runs if (r["system"], r["budget"]) == key]
        out.append({"system": key[0], "budget": key[1], "overall": median_figures([r["overall"] for r in mine]),
                    "per_model": {m: median_figures([r["per_model"][m] for r in mine]) for m in MODELS},
                    "preemptions": median_figures([r["preemptions"] for r in mine]),
                    "peak_pss_bytes": statistics.median(r["peak_pss_bytes"] for r in mine),
                    "p99_ttft_ms_rounds": [r["overall"]["p99_ttft_ms"] for r in mine]})
    return out


def verdicts(result: dict) -> list[dict]:
    """The targets, each with its figures and whether it is met: every round's requests and KV, the medians'
    TTFT; the ratios against vLLM are reported, not targets."""
    out = []
    by = {(r["system"], r["budget"]): r for r in result["medians"]}
    for r in result["runs"]:
        run = f"{r['system']}, {r['budget'] >> 20}MiB, round {r['round'] + 1}"
        out.append({"target": f"{run}: every request completed",
                    "value": r["overall"]["completed"], "bound": r["overall"]["requests"], "at_least": True,
                    "met": r["overall"]["completed"] == r["overall"]["requests"]})
        if r["system"] != "vllm":
            most = max((sum(held for held, _ in s.values()) for _, s in r["kv_over_time"]), default=0)
            out.append({"target": f"{run}: KV held never above the budget",
                        "value": most, "bound": r["budget"], "at_least": False, "met": most <= r["budget"]})
    tight = min(result["budgets"])
    if ("shared", tight) in by and ("static", tight) in by:
        ratio = by[("static", tight)]["overall"]["p99_ttft_ms"] / by[("shared", tight)]["overall"]["p99_ttft_ms"]
        out.append({"target": f"p99 TTFT, static over shared, at the tightest budget ({tight >> 20}MiB)",
                    "value": ratio, "bound": 2.0, "at_least": True, "met": ratio >= 2.0})
    return out


def ratios(result: dict) -> list[list]:
    """vLLM's p99 and median TTFT over vattn shared's, at each budget."""
    by = {(r["system"], r["budget"]): r["overall"] for r in result["medians"]}
    return [[f"{b >> 20}MiB", f"{by[('vllm', b)]['p99_ttft_ms'] / by[('shared', b)]['p99_ttft_ms']:.2f}",
             f"{by[('vllm', b)]['median_ttft_ms'] / by[('shared', b)]['median_ttft_ms']:.2f}"]
            for b in result["budgets"] if ("vllm", b) in by and ("shared", b) in by]


def _print(result: dict) -> None:
    ms = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    rows = []
    for r in result["medians"]:
        for who, f in [("all", r["overall"]), *r["per_model"].items()]:
            rows.append([r["system"], f"{r['budget'] >> 20}", who, f"{f['completed']}/{f['requests']}",
                         ms(f["median_ttft_ms"]), ms(f["p99_ttft_ms"]), ms(f["median_tpot_ms"]), ms(f["p99_tpot_ms"]),
                         f"{f['output_tok_per_s']:.1f}",
                         f"{sum(r['preemptions'].values()) if who == 'all' else r['preemptions'][who]:.0f}",
                         f"{r['peak_pss_bytes'] / 2**30:.2f}" if who == "all" else "",
                         " / ".join(map(ms, r["p99_ttft_ms_rounds"])) if who == "all" else ""])
    print_table(f"three models, staggered peaks: {result['num_requests_per_model']} ShareGPT requests each, "
                f"{result['model']} {result['dtype']}, answers ≤ {result['max_tokens']} tokens; medians of "
                f"{result['rounds']} round(s); {result['cpu']}",
                ["system", "budget MiB", "model", "done", "TTFT ms med", "TTFT p99", "TPOT ms med", "TPOT p99",
                 "out tok/s", "preempted", "peak PSS GiB", "TTFT p99 by round"], rows)
    if table := ratios(result):
        print_table("vLLM (one server a model) over vattn shared", ["budget", "p99 TTFT", "median TTFT"], table)
    for v in result["verdicts"]:
        console.print(f"{'met' if v['met'] else 'MISSED'}: {v['target']}: {v['value']:.3g} "
                      f"(target {'≥' if v['at_least'] else '≤'} {v['bound']:g})")


def _plot(result: dict, folder: Path) -> None:
    from vattn.bench.plots import line_chart

    for budget in result["budgets"]:
        series = {}
        for r in result["runs"]:
            if r["budget"] != budget or r["round"]:
                continue
            t = [s[0] for s in r["kv_over_time"]]
            series[f"{r['system']}: all"] = (t, [sum(m for _, m in s[1].values()) / 2**20 for s in r["kv_over_time"]])
            if r["system"] == "shared":
                for m in MODELS:
                    series[f"shared: {m}"] = (t, [s[1].get(m, (0, 0))[1] / 2**20 for s in r["kv_over_time"]])
        end = max((x[-1] for x, _ in series.values() if x), default=1.0)
        series["budget"] = ([0.0, end], [budget / 2**20] * 2)
        line_chart(folder / f"models_{budget >> 20}MiB.png",
                   f"KV in use over time, {budget >> 20} MiB in all (round 1)", "seconds", "MiB", series,
                   dashed={"budget"})
