"""`vattn.LLM`: offline batch generation, vLLM's way.

    llm = LLM()                                   # SmolLM2-135M-Instruct on the CPU, dtype "auto"
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    llm = LLM(tensor_parallel_size=3)             # the same, its heads split over 3 processes
"""
import time
from contextlib import contextmanager

import torch

from vattn.distributed import ranks
from vattn.engine.config import EngineConfig
from vattn.engine.llm_engine import LLMEngine
from vattn.engine.request import RequestOutput
from vattn.sampling_params import SamplingParams


class LLM:
    def __init__(self, model=None, tokenizer=None, **settings):
        """`model`: a transformers causal LM (with its `tokenizer`), a
        built-in model's name (`vattn.models`), a checkpoint's name or
        directory, a loader (`vattn.executor.loader.load`), or None for
        SmolLM2-135M-Instruct; `settings`: `EngineConfig` fields (`dtype`:
        "auto" by default, see `vattn.dtypes`).
        With `tensor_parallel_size=N` > 1 the model is loaded in N ranks, this
        process rank 0 (it starts the others, or under `torchrun` joins them:
        there only rank 0 returns from here), so it must come as a name or
        loader; bad settings are refused before any process starts."""
        config = EngineConfig(**settings)
        size = config.tensor_parallel_size
        group = None
        if isinstance(model, torch.nn.Module):
            if size > 1:
                raise ValueError("tensor_parallel_size > 1 loads the model in every rank: pass its name, its "
                                 "directory or a loader, not a loaded model")
        else:
            device_type = ranks.device_type() if size > 1 else "cpu"
            ranks.check_settings(size, model, device_type)
            group = ranks.launch(size, model, settings, device_type) if size > 1 else None
            model, loaded_tokenizer = ranks.load_here(model, group, config.dtype)
            tokenizer = tokenizer or loaded_tokenizer
        self.tokenizer = tokenizer
        try:
            self.engine = LLMEngine(model, tokenizer, config, group)
        except BaseException:
            if group is not None:
                group.shutdown()
            raise

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
        with progress_bar(len(ids), use_tqdm) as advance:
            for out in self.engine.stream():
                if out.finished:
                    done[out.request_id] = out
                    advance(out)
        return [done[i] for i in ids]

    def chat(self, conversations: list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs for chat conversations (`[{"role": ..., "content": ...}]`),
        through the tokenizer's chat template."""
        prompts = [chat_token_ids(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation through the chat template, ready for the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


@contextmanager
def progress_bar(total: int, enabled: bool):
    """A progress bar over finished requests, with output tokens/s; yields `advance(output)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[rate]}"), disable=not enabled)
    task = bar.add_task("", total=total, rate="")
    start, tokens = time.perf_counter(), 0

    def advance(out: RequestOutput) -> None:
        nonlocal tokens
        tokens += sum(len(c.token_ids) for c in out.outputs)
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        bar.update(task, advance=1, rate=f"{rate:.1f} output tok/s")

    with bar:
        yield advance
