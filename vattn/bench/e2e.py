"""`vattn bench e2e`: the same ShareGPT requests (SmolLM2, float32, greedy,
all arriving at once) through the vattn engine, the same engine on the paged
baseline, transformers' own continuous batching, and HF `generate` with static
batches; the figures `vllm bench` prints, side by side.  Every system must
give the vattn engine's tokens: the table says how many requests match."""
import gc

from vattn.bench.engine import serve, workload
from vattn.bench.report import print_table, write_json


def run(json_path: str | None, plot_dir: str | None, num_prompts: int = 64, max_tokens: int = 64,
        block_sizes: list[int] = (16,)) -> dict:
    from vattn.bench import hf_serving
    from vattn.models import ENGINE_DTYPE, load_smollm2

    model, tokenizer = load_smollm2(dtype=ENGINE_DTYPE)
    _, prompts, params = workload(tokenizer, num_prompts, max_tokens)
    runs = {"vattn": _engine(model, tokenizer, prompts, params)}
    for b in block_sizes:
        runs[f"paged_{b}"] = _engine(model, tokenizer, prompts, params, kv_cache="paged", block_size=b)
    runs["hf_continuous_batching"] = hf_serving.serve_continuous_batching(model, prompts, params)
    runs["hf_static"] = hf_serving.serve_static(model, prompts, params)
    reference = [o.outputs[0].token_ids for o in runs["vattn"][0]]
    rows = []
    for name, (outputs, f) in runs.items():
        same = sum(o.outputs[0].token_ids == r for o, r in zip(outputs, reference))
        rows.append({"system": name, "output_tok_per_s": f["output_tok_per_s"], "req_per_s": f["req_per_s"],
                     "ttft_ms": f["ttft_ms"], "tpot_ms": f["tpot_ms"], "itl_ms": f["itl_ms"], "e2el_ms": f["e2el_ms"],
                     "seconds": f["seconds"], "output_tokens": f["output_tokens"], "same_tokens_as_vattn": same})
    result = {"rows": rows, "requests": num_prompts, "max_tokens": max_tokens, "targets": targets(rows)}
    print_table(f"end to end: {num_prompts} ShareGPT prompts, SmolLM2-135M float32, answers ≤ {max_tokens} tokens",
                ["system", "output tok/s", "req/s", "TTFT ms (median)", "TPOT ms (median)", "E2EL ms (median)",
                 "same tokens as vattn"],
                [[r["system"], f"{r['output_tok_per_s']:.1f}", f"{r['req_per_s']:.2f}", f"{r['ttft_ms']['median']:,.0f}",
                  f"{r['tpot_ms']['median']:,.0f}", f"{r['e2el_ms']['median']:,.0f}",
                  f"{r['same_tokens_as_vattn']}/{num_prompts}"]
                 for r in rows])
    write_json(json_path, result)
    if plot_dir:
        from pathlib import Path

        from vattn.bench.plots import line_chart

        line_chart(Path(plot_dir) / "e2e_throughput_latency.png", "throughput vs latency (each system one point)",
                   "median E2EL (ms)", "output tok/s",
                   {r["system"]: ([r["e2el_ms"]["median"]], [r["output_tok_per_s"]]) for r in rows}, markers=True)
    return result


def _engine(model, tokenizer, prompts, params, **settings) -> tuple[list, dict]:
    """The requests through a fresh engine with `settings`."""
    from vattn import LLM

    llm = LLM(model, tokenizer, **settings)
    try:
        return serve(llm, prompts, params)
    finally:
        llm.engine.close()
        gc.collect()


def targets(rows: list[dict]) -> dict:
    """vattn's output tok/s over each other system's."""
    by = {r["system"]: r["output_tok_per_s"] for r in rows}
    return {f"vattn_vs_{name}": by["vattn"] / tps for name, tps in by.items() if name != "vattn" and tps}
