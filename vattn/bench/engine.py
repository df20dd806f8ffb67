"""`vattn bench engine` and the workload `vattn demo` serves: real ShareGPT
prompts through the engine on SmolLM2, with the figures `vllm bench` prints
and the engine's own (KV utilization, pages, preemptions, prefix hits,
mapping time on the step's critical path)."""
import statistics
import time

from vattn.bench.report import median_figures, print_table, write_json


def workload(tokenizer, num_prompts: int, max_tokens: int, seed: int = 0):
    """ShareGPT prompts as chat token ids, and greedy SamplingParams whose
    `max_tokens` is the reference reply's length, capped at `max_tokens`."""
    from vattn import SamplingParams, sharegpt

    requests = sharegpt.sample(tokenizer, num_prompts, seed=seed)
    prompts = [sharegpt.chat_prompt(tokenizer, r.prompt) for r in requests]
    params = [SamplingParams(max_tokens=min(r.output_len, max_tokens), temperature=0) for r in requests]
    return requests, prompts, params


def serve(llm, prompts, params, progress: bool = True) -> tuple[list, dict]:
    """Run the requests on `llm` (a fresh `vattn.LLM`); (outputs, figures)."""
    from vattn.engine.metrics import latency_report

    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    stats, cache = llm.engine.stats, llm.engine.cache
    step_ms = statistics.median(stats.step_seconds) * 1e3
    figures = latency_report(outputs, seconds) | {
        "kv_utilization": stats.kv_utilization,
        "step_ms_median": step_ms,
        "map_ms_per_step": statistics.fmean(stats.map_seconds) * 1e3,
        "background_map_ms_per_step": stats.background_map_seconds * 1e3 / stats.steps,
        "steps": stats.steps,
        "peak_pages": stats.peak_pages,
        "pages_total": cache.stats().pages_total,
        "page_size": cache.config.page_size,
        "layout": cache.config.layout,
        "preemptions": stats.preemptions,
        "prefix_hit_rate": stats.prefix_hit_rate,
    }
    return outputs, figures


def figure_rows(f: dict) -> list[list]:
    def lat(name):
        s = f[name]
        return f"{s['mean']:.1f} / {s['median']:.1f} / {s['p99']:.1f}"

    return [
        ["requests", f"{f['requests']} in {f['seconds']:.1f} s"],
        ["req/s", f"{f['req_per_s']:.2f}"],
        ["output tok/s", f"{f['output_tok_per_s']:.1f}"],
        ["TTFT ms (mean / median / p99)", lat("ttft_ms")],
        ["TPOT ms", lat("tpot_ms")],
        ["ITL ms", lat("itl_ms")],
        ["E2EL ms", lat("e2el_ms")],
        ["KV utilization (live / mapped, time-averaged)", f"{f['kv_utilization']:.1%}"],
        ["peak pages mapped", f"{f['peak_pages']} of {f['pages_total']} ({f['page_size'] >> 10} KiB, {f['layout']})"],
        ["preemptions", f["preemptions"]],
        ["prefix-cache hit rate", f"{f['prefix_hit_rate']:.1%}"],
        ["median step ms", f"{f['step_ms_median']:.1f}"],
        ["mapping ms per step, on the critical path", f"{f['map_ms_per_step']:.3f}"],
    ]


def run(json_path: str | None, num_prompts: int, max_tokens: int, max_num_seqs: int, device: str = "cpu",
        rounds: int = 3) -> dict:
    """Each figure the median of `rounds` runs, with and without the worker taking turns."""
    import torch

    from vattn import LLM
    from vattn.models import ENGINE_DTYPE, load_smollm2

    model, tokenizer = load_smollm2(dtype=ENGINE_DTYPE if device == "cpu" else torch.bfloat16)
    model = model.to(device)
    _, prompts, params = workload(tokenizer, num_prompts, max_tokens)
    results = {True: [], False: []}
    for _ in range(rounds):
        for map_ahead in results:
            llm = LLM(model, tokenizer, max_num_seqs=max_num_seqs, map_ahead=map_ahead)
            results[map_ahead].append(serve(llm, prompts, params)[1])
            llm.engine.close()
    worker, inline = median_figures(results[True]), median_figures(results[False])
    maps = {"with_worker": worker["map_ms_per_step"], "without_worker": inline["map_ms_per_step"]}
    shares = {"with_worker": worker["map_ms_per_step"] / worker["step_ms_median"],  # each run's own steps
              "without_worker": inline["map_ms_per_step"] / inline["step_ms_median"]}
    f = worker | {"map_ms_per_step": maps, "map_share_of_step": shares}
    rows = figure_rows(worker) + [
        ["mapping ms per step without the worker", f"{maps['without_worker']:.3f}"],
        ["mapping / median step (with / without worker)",
         f"{shares['with_worker']:.2%} / {shares['without_worker']:.2%}"]]
    print_table(f"engine: {num_prompts} ShareGPT prompts, SmolLM2-135M on {device}, max_num_seqs={max_num_seqs}, "
                f"medians of {rounds} runs", ["", ""], rows)
    write_json(json_path, f | {"rounds": {"with_worker": results[True], "without_worker": results[False]}})
    return f
