"""`vattn generate`: chat with SmolLM2 through generate(), on a cache of choice.

transformers is imported where it is used, so the `vattn` command can read the
constants below without loading it.
"""
import sys
import time

import torch

from vattn.report import print_table

CACHES = ("vattn", "dynamic", "static")
DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue."


def make_cache(kind: str, model, batch: int, max_seq_len: int):
    """A fresh cache of `kind` for `batch` rows of up to `max_seq_len` tokens."""
    from transformers import DynamicCache, StaticCache

    from vattn.integrations.hf import VAttnCache

    if kind == "vattn":
        return VAttnCache.from_model(model, max_num_seqs=batch, max_seq_len=max_seq_len)
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_seq_len)
    raise ValueError(f"unknown cache {kind!r}: choose one of {CACHES}")


def kv_bytes(cache) -> tuple[int, int]:
    """(bytes of KV memory the cache holds, bytes of the tokens it stores)."""
    from vattn.integrations.hf import VAttnCache

    if isinstance(cache, VAttnCache):
        st = cache.stats()
        return st.mapped_bytes, st.live_bytes
    held = live = 0
    for layer in cache.layers:
        if layer.keys is None or not layer.keys.numel():
            continue
        held += layer.keys.nbytes + layer.values.nbytes
        live += (layer.keys.nbytes + layer.values.nbytes) * int(layer.get_seq_length()) // layer.keys.shape[-2]
    return held, live


def run(prompt: str, max_new_tokens: int, num_beams: int, cache_kind: str, dtype: str = "auto") -> None:
    from transformers import TextStreamer

    from vattn.integrations.hf import VAttnCache
    from vattn.models import load_model

    model, tokenizer = load_model(dtype=dtype)
    chat = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    cache = make_cache(cache_kind, model, num_beams, prompt_len + max_new_tokens)
    if isinstance(cache, VAttnCache):
        model.set_attn_implementation(cache.attn_implementation)  # the kernel that reads its views in place
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if num_beams == 1 else None
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False,
                             cache=cache, streamer=streamer, pad_token_id=tokenizer.eos_token_id)
    seconds = time.perf_counter() - start
    new_tokens = out.shape[1] - prompt_len
    if streamer is None:
        print(tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True))
    sys.stdout.flush()
    held, live = kv_bytes(cache)
    rows = [["cache", cache_kind], ["tokens", f"{prompt_len} prompt + {new_tokens} new"],
            ["tokens/s", f"{new_tokens / seconds:.1f}"], ["KV bytes held", f"{held:,}"], ["KV bytes live", f"{live:,}"]]
    if isinstance(cache, VAttnCache):
        st = cache.stats()
        c = cache.kv.config
        rows += [["pages mapped / total", f"{st.pages_mapped} / {st.pages_total} of {c.page_size >> 10} KiB "
                                          f"in each of {c.num_buffers} buffers"],
                 ["pages shared", st.pages_shared], ["utilization (live / mapped)", f"{st.utilization:.1%}"],
                 ["map calls", st.map_calls]]
    print_table("KV cache", ["", ""], rows)
