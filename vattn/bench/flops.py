"""The arithmetic a workload costs a decoder-only model, and the fastest GEMM
this machine runs in a dtype, so that a system's speed reads as achieved GFLOP/s
against the machine's peak."""
import time

import torch

import vattn.executor.gemm as gemm


def _text_config(config):
    c = config.get_text_config()
    return c, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def token_flops(config) -> tuple[int, int]:
    """(FLOPs a token costs the layers' linears, FLOPs the LM head costs a
    sampled token) of a Llama-like transformers config."""
    c, head_dim = _text_config(config)
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return 2 * c.num_hidden_layers * per_layer, 2 * c.hidden_size * c.vocab_size


def workload_flops(config, requests: list[dict]) -> int:
    """FLOPs of serving `requests` (prompt ids, `max_tokens` answers, no
    prefix reused): every prompt and answer token through the layers but an
    answer's last, attention over each token's context, the LM head once per
    answer token."""
    layers, head = token_flops(config)
    c, head_dim = _text_config(config)
    attend = 4 * c.num_hidden_layers * c.num_attention_heads * head_dim  # QK and PV, a token per context token
    total = 0
    for r in requests:
        fed = len(r["prompt"]) + r["max_tokens"] - 1
        total += fed * layers + attend * fed * (fed + 1) // 2 + r["max_tokens"] * head
    return total


def gemm_peak_gflops(dtype: torch.dtype = torch.float32, repeats: int = 10) -> float:
    """The best GFLOP/s of GEMMs in `dtype` (float32, bfloat16) on every
    thread torch has: plain `mm`, oneDNN's pre-packed linear where it packs
    the dtype, and vattn's own GEMM where it runs (`vattn.executor.gemm`),
    over a few large shapes."""
    from vattn.executor.linears import packing

    best = 0.0
    for m, n, k in ((512, 1536, 576), (1024, 1024, 1024), (256, 49152, 576)):
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        calls = [lambda: x @ w.T]
        if packing(w, native_gemm=False) == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            calls.append(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        if gemm.serves(w):
            panels = gemm.pack(w)
            calls.append(lambda: gemm.linear(x, panels, n))
        for f in calls:
            f()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                f()
                times.append(time.perf_counter() - start)
            best = max(best, 2 * m * n * k / min(times) / 1e9)
    return best
