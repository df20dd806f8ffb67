"""The workload `vattn demo` serves and `vattn bench engine` measures: real
ShareGPT prompts through the engine, with the figures `vllm bench` prints and
the engine's own (KV utilization, pages, preemptions, prefix hits, mapping
time on the step's critical path)."""
import statistics
import time


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
    stats, kv = llm.engine.stats, llm.engine.kv
    step_ms = statistics.median(stats.step_seconds) * 1e3
    figures = latency_report(outputs, seconds) | {
        "kv_utilization": stats.kv_utilization,
        "step_ms_median": step_ms,
        "decode_step_ms_median": statistics.median(stats.decode_step_seconds or [float("nan")]) * 1e3,
        "map_ms_per_step": stats.total_map_seconds * 1e3 / stats.steps,
        "background_map_ms_per_step": stats.background_map_seconds * 1e3 / stats.steps,
        "steps": stats.steps,
        "peak_pages": stats.peak_pages,
        "pages_total": kv.num_pages,
        "page_size": kv.config.page_size,
        "num_buffers": kv.config.num_buffers,
        "layout": kv.config.layout,
        "preemptions": stats.preemptions,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "attention": llm.engine.runner.kernel.name,
        "per_request_decodes": stats.per_request_decodes,
        "linear_gemms": llm.engine.runner.linears.num_gemms,
        "linear_weight_bytes": llm.engine.runner.linears.nbytes,
        "linear_bytes_held_twice": llm.engine.runner.linears.held_twice,
        "linear_bytes_paged_out": llm.engine.runner.linears.paged_out,
        "tensor_parallel_size": llm.engine.config.tensor_parallel_size,
        "kv_bytes_per_rank": {"peak": stats.peak_pages * kv.config.page_bytes,
                              "budget": kv.num_pages * kv.config.page_bytes},
        "broadcast_ms_per_step": stats.broadcast_seconds * 1e3 / stats.steps,
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
        ["KV utilization (live / mapped, over time)", f"{f['kv_utilization']:.1%}"],
        ["peak pages mapped (of the budget)", f"{f['peak_pages']} of {f['pages_total']}"],
        ["a page", f"{f['page_size'] >> 10} KiB × {f['num_buffers']} buffers, {f['layout']}"],
        ["preemptions", f["preemptions"]],
        ["prefix-cache hit rate", f"{f['prefix_hit_rate']:.1%}"],
        ["attention kernel", f"{f['attention']}"],
        ["layers decoded a call per request", f"{f['per_request_decodes']}"],
        ["median step ms (all / decode only)", f"{f['step_ms_median']:.1f} / {f['decode_step_ms_median']:.1f}"],
        ["mapping ms a step, on its critical path", f"{f['map_ms_per_step']:.3f}"],
        ["served linears: GEMMs, MiB (held twice)",
         f"{f['linear_gemms']}, {f['linear_weight_bytes'] / 2**20:.0f} ({f['linear_bytes_held_twice'] / 2**20:.0f})"],
        ["tensor-parallel ranks", f"{f['tensor_parallel_size']}"],
        ["KV MiB a rank (peak / budget)",
         f"{f['kv_bytes_per_rank']['peak'] / 2**20:.1f} / {f['kv_bytes_per_rank']['budget'] / 2**20:.1f}"],
        ["broadcast ms a step", f"{f['broadcast_ms_per_step']:.3f}"],
    ]
