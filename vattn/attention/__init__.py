"""Attention over the KV cache, for the engine's forward passes.

One forward holds several requests back to back (`StepBatch`).  Every layer
writes its new K/V into the cache at each request's own positions and attends
over that request's live tokens only, with the kernel the engine picked
(`registry.pick`, by the device, dtype, cache kind and head dim, or by name):
vattn's own CPU kernel (`native`) for a float32 or bfloat16 virtual cache on
the host, FlashAttention (`flash`) on CUDA with flash-attn installed and a
16-bit virtual cache, else torch SDPA (`sdpa`).

`register()` makes `attention` available to transformers as
`attn_implementation="vattn"`; it expects `vattn_batch=StepBatch` among the
model's keyword arguments, which transformers passes through to attention.
"""
from vattn.attention.flash import flash_attn_with_kvcache  # None without flash-attn; the kernel benchmarks call it
from vattn.attention.metadata import StepBatch
from vattn.attention.sdpa import decode, prefill

__all__ = ["NAME", "StepBatch", "attention", "decode", "flash_attn_with_kvcache", "prefill", "register"]

NAME = "vattn"


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              vattn_batch: StepBatch | None = None, **kwargs):
    """transformers' attention-interface signature: `query [1, H, T, D]`,
    `key`/`value [1, H_kv, T, D]`; returns `([1, T, H, D], None)`."""
    if vattn_batch is None:
        raise RuntimeError('attn_implementation="vattn" runs inside vattn.LLMEngine steps only')
    b, layer = vattn_batch, module.layer_idx
    if query.shape[2] != b.num_tokens:
        raise ValueError(f"the forward has {query.shape[2]} tokens; its StepBatch describes {b.num_tokens}")
    q = query[0].transpose(0, 1)  # [T, H, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    b.write(layer, k, v, store=not b.kernel.stores_kv)
    return b.kernel.run(b, layer, q, k, v, scaling, sliding_window).unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
