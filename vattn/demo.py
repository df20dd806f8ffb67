"""`vattn demo`: SmolLM2 serves real ShareGPT prompts through the engine."""
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel

from vattn.report import print_table, write_json
from vattn.workload import figure_rows, serve, workload


def run(num_prompts: int, max_tokens: int, show: int, json_path: str | None = None,
        tensor_parallel_size: int = 1, dtype: str = "auto") -> dict:
    from vattn import LLM

    llm = LLM(tensor_parallel_size=tensor_parallel_size, dtype=dtype)  # SmolLM2, split over that many ranks
    requests, prompts, params = workload(llm.tokenizer, num_prompts, max_tokens)
    try:
        outputs, figures = serve(llm, prompts, params)
    finally:
        llm.engine.close()
    console = Console()
    for req, out in list(zip(requests, outputs))[:show]:
        answer = out.outputs[0].text.strip()
        console.print(Panel(f"[bold]{escape(_clip(req.prompt, 300))}[/bold]\n\n{escape(_clip(answer, 500))}",
                            title=f"request {out.request_id}: {len(out.prompt_token_ids)} prompt tokens, "
                                  f"{len(out.outputs[0].token_ids)} generated ({out.outputs[0].finish_reason})",
                            title_align="left"))
    dtype = str(llm.engine.model.dtype).removeprefix("torch.")
    print_table(title(len(outputs), tensor_parallel_size, dtype), ["", ""], figure_rows(figures))
    write_json(json_path, figures)
    return figures


def title(num_prompts: int, tensor_parallel_size: int, dtype: str) -> str:
    ranks = f", {tensor_parallel_size} tensor-parallel ranks" if tensor_parallel_size > 1 else ""
    return f"vattn demo: {num_prompts} ShareGPT prompts, SmolLM2-135M {dtype}{ranks}"


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 1] + "…"
