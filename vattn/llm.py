"""`vattn.LLM`: offline batch generation, vLLM's way.

    llm = LLM()                                   # SmolLM2-135M-Instruct on the CPU
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""
from vattn.engine import EngineConfig, LLMEngine, RequestOutput
from vattn.sampling_params import SamplingParams


class LLM:
    def __init__(self, model=None, tokenizer=None, **settings):
        """`model`: a transformers causal LM (with its `tokenizer`), or None
        for SmolLM2-135M-Instruct; `settings`: `EngineConfig` fields."""
        if model is None:
            from vattn.models import ENGINE_DTYPE, load_smollm2

            model, tokenizer = load_smollm2(dtype=ENGINE_DTYPE)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, tokenizer, EngineConfig(**settings))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """Outputs for `prompts` (texts or token-id lists; one prompt alone is
        fine), in order; a progress bar shows finished requests and tokens/s."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt))
        except Exception:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        done = {}
        with _progress(len(ids), use_tqdm) as advance:
            for out in self.engine.stream():
                if out.finished:
                    done[out.request_id] = out
                    advance(out)
        return [done[i] for i in ids]

    def chat(self, conversations: list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs for chat conversations (`[{"role": ..., "content": ...}]`),
        through the tokenizer's chat template."""
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
                   for c in conversations]
        return self.generate([list(p) for p in prompts], sampling_params, use_tqdm)


class _progress:
    """A rich progress bar over finished requests, with output tokens/s."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def __enter__(self):
        import time

        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.start, self.tokens = time.perf_counter(), 0
        self._time = time.perf_counter
        self.bar = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.fields[rate]}"), disable=not self.enabled)
        self.task = self.bar.add_task("", total=self.total, rate="")
        self.bar.__enter__()
        return self.advance

    def advance(self, out: RequestOutput) -> None:
        self.tokens += sum(len(c.token_ids) for c in out.outputs)
        rate = self.tokens / max(self._time() - self.start, 1e-9)
        self.bar.update(self.task, advance=1, rate=f"{rate:.1f} output tok/s")

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)
