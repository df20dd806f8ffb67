"""`vattn bench hf`: VAttnCache against transformers' DynamicCache and StaticCache
inside generate() on SmolLM2, all in one run.

Throughput is batch / median time per decode step (each step timed by a
streamer hook, so prefill is left out); KV bytes are what each cache holds
after the last token (VAttnCache: mapped pages) against the bytes of the
tokens stored.  Beam reorder: 4 rows at 1024 tokens of context, each step
appends a token and reorders with a random beam index, as beam search does;
the reorder alone is timed.  `--attn vattn_sdpa` runs every cache on
`sdpa_same_kernel`, registered here.
"""
import random
import statistics
import time

import torch
from transformers import AttentionInterface
from transformers.generation.streamers import BaseStreamer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import vattn.integrations.hf  # noqa: F401  (registers "vattn_native")
from vattn.generate import CACHES, kv_bytes, make_cache
from vattn.report import console, print_table, write_json

PROMPTS = [
    "Explain why the sky is blue.", "Write a haiku about autumn.", "What is a hash table?",
    "Give me three tips for learning to cook.", "Summarise the plot of Hamlet.", "How do vaccines work?",
    "Describe a good morning routine.", "What causes the seasons on Earth?",
]


def sdpa_same_kernel(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, except that a single decode token with
    grouped KV heads always takes the packed-GQA kernel.  transformers picks it
    only when a mask is present and otherwise asks torch for `enable_gqa`,
    several times slower on CPU in bfloat16, so the kernel would depend on whether the
    cache makes a mask (StaticCache does) rather than on the work.  An all-true
    mask changes no result."""
    if attention_mask is None and query.shape[2] == 1 and query.shape[1] != key.shape[1]:
        attention_mask = torch.ones(1, 1, 1, key.shape[2], dtype=torch.bool, device=query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("vattn_sdpa", sdpa_same_kernel)  # `vattn bench hf --attn vattn_sdpa`


class StepClock(BaseStreamer):
    """Records when generate() emits each step's tokens."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]  # times[0]: the prompt; [1]: after prefill


def decode_run(model, tokenizer, kind: str, batch: int, new_tokens: int) -> dict:
    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(batch)]
    inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True, padding=True)
    prompt_len = inputs["input_ids"].shape[1]
    cache = make_cache(kind, model, batch, prompt_len + new_tokens)
    clock = StepClock()
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       cache=cache, streamer=clock, pad_token_id=tokenizer.eos_token_id)
    held, live = kv_bytes(cache)
    steps = clock.step_seconds()
    return {"cache": kind, "batch": batch, "new_tokens": new_tokens,
            "tokens_per_s": batch / statistics.median(steps),
            "tokens_per_s_overall": batch * len(steps) / sum(steps),
            "kv_bytes_committed": held, "kv_bytes_live": live}


def beam_reorder_ms(model, kind: str, context: int = 1024, beams: int = 4, steps: int = 40, seed: int = 0) -> float:
    c = model.config
    heads, dim = c.num_key_value_heads, c.head_dim
    cache = make_cache(kind, model, beams, context + steps + 1)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    new = lambda n: torch.randn(beams, heads, n, dim, generator=g).to(model.dtype)  # noqa: E731
    for layer in range(c.num_hidden_layers):
        cache.update(new(context), new(context), layer)
    times = []
    for _ in range(steps):
        for layer in range(c.num_hidden_layers):
            cache.update(new(1), new(1), layer)
        beam_idx = torch.tensor([rng.randrange(beams) for _ in range(beams)])
        start = time.perf_counter()
        cache.reorder_cache(beam_idx)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(json_path: str | None = None, batches=(1, 8), new_tokens=(512, 2048), attn: str = "sdpa",
        dtype: str = "auto") -> dict:
    from vattn.models import load_model

    model, tokenizer = load_model(dtype=dtype, attn_implementation=attn)
    tokenizer.padding_side = "left"
    decode_run(model, tokenizer, "dynamic", 1, 8)  # warm-up: first-call costs land on no contender
    results = []
    for i, (n, batch) in enumerate((n, b) for n in new_tokens for b in batches):
        for kind in CACHES[i % 3:] + CACHES[:i % 3]:  # rotate which cache runs first
            results.append(r := decode_run(model, tokenizer, kind, batch, n))
            print(f"  {kind:8} batch {batch} × {n} tokens: {r['tokens_per_s']:.1f} tok/s", flush=True)
    reorder = {kind: beam_reorder_ms(model, kind) for kind in ("vattn", "dynamic")}
    by = {(r["cache"], r["batch"], r["new_tokens"]): r for r in results}
    rows = []
    for n in new_tokens:
        for batch in batches:
            v = by["vattn", batch, n]
            for kind in CACHES:
                r = by[kind, batch, n]
                rows.append([f"{kind} b{batch} n{n}", r["tokens_per_s"], v["tokens_per_s"] / r["tokens_per_s"],
                             r["kv_bytes_committed"] / 2**20, r["kv_bytes_committed"] / r["kv_bytes_live"]])
    print_table(f"SmolLM2 generate() with {attn} attention: decode throughput (batch / median step) and KV memory",
                ["cache / batch / new tokens", "tok/s", "vattn ×", "KV MiB held", "held / live"], rows)
    print_table("beam search, 4 beams at 1024 tokens: cache reorder per step (median ms)",
                ["cache", "ms", "vattn speed-up"],
                [[k, ms, reorder[k] / reorder["vattn"]] for k, ms in reorder.items()])
    result = {"attn_implementation": attn, "results": results, "beam_reorder_ms": reorder,
              "targets": targets(by, batches, new_tokens, reorder)}
    for name, t in result["targets"].items():
        console.print(f"target {name}: {t['measured']:.3f} (goal {t['goal']}) " + ("met" if t["met"] else "MISSED"))
    write_json(json_path, result)
    return result


def targets(by: dict, batches, new_tokens, reorder: dict) -> dict:
    """Throughput ≥ 0.95× StaticCache and ≥ 1.0× DynamicCache at every point; committed KV ≤ 1.1× live
    at the longest run; beam reorder ≥ 3× faster than DynamicCache's."""
    out = {}
    for n in new_tokens:
        for batch in batches:
            v = by["vattn", batch, n]["tokens_per_s"]
            for kind, goal in (("static", 0.95), ("dynamic", 1.0)):
                ratio = v / by[kind, batch, n]["tokens_per_s"]
                out[f"vattn/{kind} tok/s b{batch} n{n}"] = {"measured": ratio, "goal": f">= {goal}",
                                                             "met": ratio >= goal}
    for batch in batches:
        r = by["vattn", batch, max(new_tokens)]
        held = r["kv_bytes_committed"] / r["kv_bytes_live"]
        out[f"vattn KV held/live b{batch} n{max(new_tokens)}"] = {"measured": held, "goal": "<= 1.1",
                                                                   "met": held <= 1.1}
    speedup = reorder["dynamic"] / reorder["vattn"]
    out["beam reorder speed-up over dynamic"] = {"measured": speedup, "goal": ">= 3", "met": speedup >= 3}
    return out
