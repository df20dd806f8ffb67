"""`vattn bench sweep`: the engine's batch limits measured, to choose its
defaults: `bench e2e`'s workload and KV budget through `vattn` workers, one
per (`max_num_seqs`, `max_num_batched_tokens`), taking turns in each round;
each figure the median of `rounds` rounds."""
import itertools
import tempfile
from pathlib import Path

from vattn.bench import e2e
from vattn.bench.report import median_figures
from vattn.report import console, print_table, write_json


def run(json_path: str | None, max_num_seqs: list[int], max_num_batched_tokens: list[int],
        workload: str = "sharegpt", num_prompts: int | None = None, max_tokens: int | None = None,
        rate: float = float("inf"), rounds: int = 3) -> dict:
    from vattn.config import CacheConfig, resolve
    from vattn.engine import EngineConfig
    from vattn.models import ENGINE_DTYPE, load_smollm2

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    sizes = e2e.WORKLOADS[workload] | {k: v for k, v in dict(num_prompts=num_prompts, max_tokens=max_tokens).items()
                                       if v}
    model, tokenizer = load_smollm2(dtype=ENGINE_DTYPE)
    budget = e2e.default_budget(resolve(CacheConfig.from_model(model, **EngineConfig().cache_settings())))
    reqs = e2e.requests(tokenizer, workload, **sizes)
    del model
    due = e2e.arrivals(len(reqs), rate)
    grid = list(itertools.product(max_num_seqs, max_num_batched_tokens))
    log = Path(tempfile.mkdtemp(prefix="vattn-sweep-logs-"))
    workers, runs = {}, {point: [] for point in grid}
    try:
        for seqs, tokens in grid:
            options = {"memory_budget": budget, "max_num_seqs": seqs, "max_num_batched_tokens": tokens}
            workers[seqs, tokens] = worker = e2e.Worker("vattn", options, log / f"vattn_{seqs}_{tokens}.log")
            worker.serve(reqs[:4], [0.0] * min(4, len(reqs)))  # warm-up, not timed
        for k in range(rounds):
            for point in grid[k % len(grid):] + grid[:k % len(grid)]:
                console.print(f"round {k + 1}/{rounds}: max_num_seqs={point[0]}, max_num_batched_tokens={point[1]}")
                runs[point].append(e2e.figures(workers[point].serve(reqs, due), reqs))
    finally:
        for w in workers.values():
            w.close()
    rows = [{"max_num_seqs": s, "max_num_batched_tokens": t} | median_figures(runs[s, t]) | {"rounds": runs[s, t]}
            for s, t in grid]
    best = max(rows, key=lambda r: r["output_tok_per_s"])
    result = {"workload": workload, **sizes, "prompt_tokens": sum(len(r["prompt"]) for r in reqs),
              "request_rate": e2e.rate_label(rate), "kv_budget_bytes": budget, "rounds_per_figure": rounds,
              "rows": rows, "best": {k: best[k] for k in ("max_num_seqs", "max_num_batched_tokens")}}
    print_table(f"engine sweep: {len(reqs)} {workload} requests, rate {e2e.rate_label(rate)}, EOS ignored, "
                f"KV budget {budget / 2**30:.2f} GiB; medians of {rounds} rounds",
                ["max_num_seqs", "max_num_batched_tokens", "output tok/s", "TTFT ms median", "TPOT ms median", ""],
                [[r["max_num_seqs"], r["max_num_batched_tokens"], f"{r['output_tok_per_s']:.1f}",
                  f"{r['ttft_ms']['median']:,.0f}", f"{r['tpot_ms']['median']:,.0f}", "best" if r is best else ""]
                 for r in rows])
    write_json(json_path, result)
    return result
