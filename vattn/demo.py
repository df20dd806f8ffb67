"""`vattn demo`: SmolLM2 serves real ShareGPT prompts through the engine, its
KV memory drawn from a pool it could share with other models (one rank)."""
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from vattn.report import print_table, write_json
from vattn.workload import figure_rows, serve, workload

KV_POOL_BYTES = 1 << 30  # the demo's prompts take about half of it in float32


def run(num_prompts: int, max_tokens: int, show: int, json_path: str | None = None,
        tensor_parallel_size: int = 1, dtype: str = "auto") -> dict:
    from vattn import LLM, KVPool

    pool = KVPool(KV_POOL_BYTES) if tensor_parallel_size == 1 else None  # a pool serves one rank's caches
    shared = {"kv_pool": pool.add("smollm2")} if pool else {}
    llm = LLM(tensor_parallel_size=tensor_parallel_size, dtype=dtype, **shared)  # SmolLM2, over that many ranks
    requests, prompts, params = workload(llm.tokenizer, num_prompts, max_tokens)
    dtype = str(llm.engine.model.dtype).removeprefix("torch.")
    try:
        outputs, figures = serve(llm, prompts, params)
        split = pool_split(pool) if pool is not None else None  # before the cache goes, giving its chunks back
    finally:
        llm.engine.close()
    console = Console()
    for req, out in list(zip(requests, outputs))[:show]:
        answer = out.outputs[0].text.strip()
        console.print(Panel(f"[bold]{escape(_clip(req.prompt, 300))}[/bold]\n\n{escape(_clip(answer, 500))}",
                            title=f"request {out.request_id}: {len(out.prompt_token_ids)} prompt tokens, "
                                  f"{len(out.outputs[0].token_ids)} generated ({out.outputs[0].finish_reason})",
                            title_align="left"))
    print_table(title(len(outputs), tensor_parallel_size, dtype), ["", ""], figure_rows(figures))
    if split is not None:
        print_table(*split)
    write_json(json_path, figures)
    return figures


def title(num_prompts: int, tensor_parallel_size: int, dtype: str) -> str:
    ranks = f", {tensor_parallel_size} tensor-parallel ranks" if tensor_parallel_size > 1 else ""
    return f"vattn demo: {num_prompts} ShareGPT prompts, SmolLM2-135M {dtype}{ranks}"


def pool_split(pool) -> tuple[str, list[str], list[list]]:
    """The title, columns and rows of a table of the pool's split among its models, in MiB."""
    kinds = ("floor", "cap", "held", "mapped", "idle")
    title = (f"the KV pool: {pool.memory_budget >> 20} MiB in chunks of {pool.chunk_size >> 20} MiB, "
             f"{pool.free_chunks * pool.chunk_size >> 20} MiB free")
    return title, ["model", *(f"{k} MiB" for k in kinds)], [
        [name, *(f"{getattr(split, k) / 2**20:,.1f}" for k in kinds)] for name, split in pool.split().items()]


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"
