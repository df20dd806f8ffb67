"""`vattn bench sweep`: the engine's batch limits measured, to choose its
defaults: `bench e2e`'s workload and KV budget through `vattn` workers, one
per point of the grid of `LIMITS`' values, taking turns in each round; each
figure the median of `rounds` rounds."""
import itertools
import tempfile
from pathlib import Path

from vattn.bench import e2e
from vattn.bench.report import median_figures
from vattn.report import console, print_table, write_json

LIMITS = ("max_num_seqs", "max_num_batched_tokens", "max_running_tokens")  # the `EngineConfig` settings swept


def run(json_path: str | None, limits: dict[str, list], workload: str = "sharegpt", num_prompts: int | None = None,
        max_tokens: int | None = None, rate: float = float("inf"), rounds: int = 3, dtype: str = "auto") -> dict:
    """`limits`: the values of each of `LIMITS` to try, over SmolLM2 in the dtype `dtype` serves."""
    from vattn.config import resolve
    from vattn.engine import EngineConfig
    from vattn.models import load_model, model_dir

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    sizes = e2e.WORKLOADS[workload] | {k: v for k, v in dict(num_prompts=num_prompts, max_tokens=max_tokens).items()
                                       if v}
    model, tokenizer = load_model(dtype=dtype)
    served = str(model.dtype).removeprefix("torch.")
    engine = EngineConfig().for_model(model)
    budget = e2e.default_budget(resolve(engine.cache_config(model)))
    reqs = e2e.requests(tokenizer, workload, **sizes)
    del model
    due = e2e.arrivals(len(reqs), rate)
    grid = [dict(zip(LIMITS, point)) for point in itertools.product(*(limits[name] for name in LIMITS))]
    log = Path(tempfile.mkdtemp(prefix="vattn-sweep-logs-"))
    workers, runs = [], [[] for _ in grid]
    try:
        for point in grid:
            name = "_".join(str(v) for v in point.values())
            workers.append(e2e.Worker("vattn", {"memory_budget": budget} | point, log / f"vattn_{name}.log",
                                      str(model_dir()), served, wait=False))
        for w in workers:
            w.wait_ready().serve(reqs[:4], [0.0] * min(4, len(reqs)))  # warm-up, not timed
        for k in range(rounds):
            for i in [*range(k % len(grid), len(grid)), *range(k % len(grid))]:
                console.print(f"round {k + 1}/{rounds}: " + ", ".join(f"{n}={v}" for n, v in grid[i].items()))
                runs[i].append(e2e.figures(workers[i].serve(reqs, due), reqs))
    finally:
        for w in workers:
            w.close()
    rows = [point | median_figures(r) | {"rounds": r} for point, r in zip(grid, runs)]
    best = max(rows, key=lambda r: r["output_tok_per_s"])
    result = {"workload": workload, **sizes, "prompt_tokens": sum(len(r["prompt"]) for r in reqs),
              "request_rate": e2e.rate_label(rate), "kv_budget_bytes": budget, "rounds_per_figure": rounds,
              "rows": rows, "best": {name: best[name] for name in LIMITS}}
    print_table(f"engine sweep: {len(reqs)} {workload} requests, rate {e2e.rate_label(rate)}, EOS ignored, "
                f"KV budget {budget / 2**30:.2f} GiB; medians of {rounds} rounds",
                [*LIMITS, "output tok/s", "TTFT ms median", "TPOT ms median", "KV GiB", ""],
                [[*(r[name] for name in LIMITS), f"{r['output_tok_per_s']:.1f}", f"{r['ttft_ms']['median']:,.0f}",
                  f"{r['tpot_ms']['median']:,.0f}", f"{r['kv_bytes_committed'] / 2**30:.2f}",
                  "best" if r is best else ""] for r in rows])
    write_json(json_path, result)
    return result
