"""`vattn bench engine`: the workload `vattn demo` serves (`vattn.workload`),
real ShareGPT prompts through the engine on SmolLM2, with and without the
mapping worker taking turns; each figure the median of several rounds."""
from vattn.bench.report import median_figures
from vattn.report import print_table, write_json
from vattn.workload import figure_rows, serve, workload


def run(json_path: str | None, num_prompts: int, max_tokens: int, max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None, device: str = "cpu", rounds: int = 3,
        attention: str | None = None, tensor_parallel_size: int = 1, dtype: str = "auto") -> dict:
    """Each figure the median of `rounds` runs, with and without the worker
    taking turns; `attention` names the engine's kernel; None: the engine's
    default (of each setting).  SmolLM2 in the dtype `dtype` serves on the
    CPU (bfloat16 on a GPU).  With `tensor_parallel_size` > 1 every run
    starts its ranks anew, each loading its shard of it."""
    import torch

    from vattn import LLM
    from vattn.models import load_model

    if tensor_parallel_size > 1:
        from transformers import AutoTokenizer

        from vattn.models import model_dir

        model, tokenizer = None, AutoTokenizer.from_pretrained(model_dir())  # each rank loads its own shard
    else:
        model, tokenizer = load_model(dtype=dtype if device == "cpu" else torch.bfloat16)
        model = model.to(device)
    _, prompts, params = workload(tokenizer, num_prompts, max_tokens)
    results = {True: [], False: []}
    for _ in range(rounds):
        for map_ahead in results:
            limits = {k: v for k, v in dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
                      .items() if v is not None}
            llm = LLM(model, tokenizer, map_ahead=map_ahead, attention=attention,
                      tensor_parallel_size=tensor_parallel_size, dtype=dtype if model is None else "auto", **limits)
            try:
                results[map_ahead].append(serve(llm, prompts, params)[1])
            finally:
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
    kernel, config = llm.engine.runner.kernel.name, llm.engine.config
    ranks = f", {tensor_parallel_size} tensor-parallel ranks" if tensor_parallel_size > 1 else ""
    print_table(f"engine: {num_prompts} ShareGPT prompts, SmolLM2-135M on {device}{ranks}, "
                f"max_num_seqs={config.max_num_seqs}, max_num_batched_tokens={config.max_num_batched_tokens}, "
                f"{kernel} attention, medians of {rounds} runs",
                ["", ""], rows)
    write_json(json_path, f | {"attention": kernel,
                               "rounds": {"with_worker": results[True], "without_worker": results[False]}})
    return f
