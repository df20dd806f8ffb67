"""`vattn bench kernels`: attention over three KV layouts holding the same K/V.

- `vattn`: a `VirtualKVCache` with the engine's default layout and page size
  for the device (`per_head`, 8 KiB on the host), read through `rows_kv`
  (zero-copy strided views);
- `contiguous`: ordinary `[B, H_kv, L, D]` tensors, the layout SDPA reads best;
- `paged`: a `PagedKVCache` with the engine's block size, whose `rows_kv`
  gathers through the block tables into a reused buffer (on CPU there is no
  paged kernel, so gather + SDPA is the paged path, and the gather is timed).

Every layout runs the engine's own kernels (`vattn.attention`) on one layer of
a model's GQA shape, reading K/V through `rows_kv` inside the timed call.
Decode: one token for each of B requests at `context` tokens, one batched
`decode` call.  Prefill: for each of B requests a causal chunk of the
engine's `max_num_batched_tokens` (256, or the whole context if shorter)
ending at `context`, one `prefill` call per chunk, as the engine does.  What
the engine builds once per step for all layers (the decode mask, the paged
gather index) is built before timing.  The layouts take turns within each
repeat, so load elsewhere on the machine hits all three alike; each figure is
the median of `repeats` runs after a warm-up run.

On CUDA (`--device cuda`) the caches live on the GPU, the virtual one in the
engine's CUDA layout (interleaved, pages of the driver's granularity), and
each timed call ends with a device synchronize.  With flash-attn installed,
two more layouts run `flash_attn_with_kvcache`: over the virtual cache's views
(`vattn_flash`, the engine's CUDA path) and over a contiguous
`[B, L, H_kv, D]` cache (`contiguous_flash`).

Thinned grid: prefill runs at the smallest batch only (a forward holds at most
one 256-token chunk, and B chunks are B calls: B times the time, the same
ratios), and dtypes other than float32 skip the largest batch × context of
each phase (the costliest point, with the ratios of its neighbours).
"""
import statistics
import time
from pathlib import Path

import torch
from rich.progress import Progress

from vattn import attention
from vattn.attention import StepBatch, decode, prefill
from vattn.bench.plots import line_chart
from vattn.bench.report import console, print_table, write_json
from vattn.cache import VirtualKVCache
from vattn.config import CacheConfig
from vattn.engine import EngineConfig
from vattn.paged import PagedKVCache

MODELS = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # query heads, KV heads, head_dim
LAYOUTS = ("vattn", "contiguous", "paged")
GOALS = {"vattn/contiguous": 1.05, "vattn/paged": 0.6}  # at most: float32 decode, batch 8, context 2048


class Contiguous:
    """`[B, H_kv, L, D]` K and V behind the `rows_kv` the kernels read."""

    def __init__(self, config: CacheConfig):
        shape = (config.max_batch, config.num_kv_heads, config.max_seq_len, config.head_dim)
        self.config, self.device = config, torch.device(config.device)
        self.k, self.v = (torch.empty(shape, dtype=config.dtype, device=config.device) for _ in "kv")

    def rows_kv(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[lo:hi, :, :length].transpose(1, 2), self.v[lo:hi, :, :length].transpose(1, 2)

    def readable(self, lo: int, hi: int, length: int) -> bool:
        return True


def layouts(device: str) -> tuple[str, ...]:
    flash = device != "cpu" and attention.flash_attn_with_kvcache is not None
    return LAYOUTS + (("vattn_flash", "contiguous_flash") if flash else ())


def make_layouts(model: str, dtype: torch.dtype, batch: int, context: int, device: str = "cpu",
                 seed: int = 0) -> dict:
    """The layouts, each holding the same random K/V of `batch` requests at `context` tokens."""
    engine = EngineConfig()
    _, Hkv, D = MODELS[model]
    settings = engine.cache_settings(torch.device(device))
    config = CacheConfig(1, Hkv, D, dtype, max_batch=batch, max_seq_len=context, page_size=settings["page_size"],
                         layout=settings["layout"], device=device)
    caches = {"vattn": VirtualKVCache(config), "contiguous": Contiguous(config),
              "paged": PagedKVCache(config, block_size=engine.block_size)}
    g = torch.Generator().manual_seed(seed)
    for slot in range(batch):
        k, v = (torch.randn(1, context, Hkv, D, generator=g).to(dtype).to(device) for _ in "kv")
        caches["contiguous"].k[slot], caches["contiguous"].v[slot] = k[0].transpose(0, 1), v[0].transpose(0, 1)
        for cache in (caches["vattn"], caches["paged"]):
            assert cache.allocate(context) == slot
            cache.write(0, [slot], [0], k, v)
    if "vattn_flash" in layouts(device):
        caches["vattn_flash"] = caches["vattn"]
        caches["contiguous_flash"] = caches["contiguous"].k.transpose(1, 2), caches["contiguous"].v.transpose(1, 2)
    return caches


def make_queries(phase: str, model: str, batch: int, context: int, dtype: torch.dtype, device: str = "cpu",
                 seed: int = 1) -> torch.Tensor:
    """Decode: `[B, H, D]`, one token per request; prefill: `[B, n, H, D]`, each request's last n tokens."""
    H, _, D = MODELS[model]
    n = 1 if phase == "decode" else min(EngineConfig().max_num_batched_tokens, context)
    q = torch.randn(batch, n, H, D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    return q[:, 0] if phase == "decode" else q


def kernel(phase: str, cache, q: torch.Tensor, context: int, name: str = "vattn"):
    """A call running `phase` attention of `q` over `cache` (layer 0), returning its output: the
    engine's kernels, or for the `*_flash` layouts `flash_attn_with_kvcache` over the same K/V."""
    B, scale = q.shape[0], q.shape[-1] ** -0.5
    if name.endswith("_flash"):
        return _flash_kernel(phase, cache, q, context, name)
    if phase == "decode":
        step = StepBatch(cache, list(range(B)), [context - 1] * B, [])
        step.decode_mask(None)
        return lambda: decode(step, 0, q, scale, None)
    start = context - q.shape[1]
    return lambda: torch.stack([prefill(q[i], *(t[0] for t in cache.rows_kv(0, i, i + 1, context)), start, scale,
                                         None) for i in range(B)])


def _flash_kernel(phase: str, cache, q: torch.Tensor, context: int, name: str):
    """`flash_attn_with_kvcache` reading each request's `context` tokens (the
    query's own K/V among them, so nothing is appended)."""
    B, n = q.shape[0], 1 if phase == "decode" else q.shape[1]
    q = q[:, None] if phase == "decode" else q
    K, V = cache.layer_kv(0) if name == "vattn_flash" else cache
    lengths = torch.full((B,), context, dtype=torch.int32, device=q.device)
    slots = torch.arange(B, dtype=torch.int32, device=q.device)
    return lambda: attention.flash_attn_with_kvcache(q, K, V, cache_seqlens=lengths, cache_batch_idx=slots,
                                                     softmax_scale=q.shape[-1] ** -0.5, causal=n > 1)


def median_ms(calls: dict, repeats: int) -> dict[str, float]:
    """Median ms of each call, the calls taking turns after a warm-up run of
    each; on CUDA each call ends with a synchronize."""
    samples = {name: [] for name in calls}
    for call in calls.values():
        call()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            sync()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def grid(batches: list[int], contexts: list[int], dtypes: list[str]) -> list[tuple]:
    """(phase, dtype, model, batch, context) to measure, thinned as the module says."""
    points = []
    for phase, sizes in {"decode": [(b, c) for b in batches for c in contexts],
                         "prefill": [(min(batches), c) for c in contexts]}.items():
        largest = max(sizes, key=lambda s: s[0] * s[1]) if len(sizes) > 1 else None
        points += [(phase, dtype, model, b, c) for dtype in dtypes for model in MODELS for b, c in sizes
                   if dtype == "float32" or (b, c) != largest]
    return points


def run(json_path: str | None, plot_dir: str | None, batches: list[int] = [1, 8, 32],
        contexts: list[int] = [512, 2048, 8192], dtypes: list[str] = ["float32", "bfloat16"],
        repeats: int = 15, device: str = "cpu") -> dict:
    results = {}  # point -> {layout: ms}
    names = layouts(device)
    with Progress(console=console, transient=True) as bar, torch.inference_mode():
        points = grid(batches, contexts, dtypes)
        task = bar.add_task("attention kernels", total=len(points))
        for point in points:
            phase, dtype, model, batch, context = point
            bar.update(task, description=f"{phase} {dtype} {model} batch {batch} context {context}")
            caches = make_layouts(model, getattr(torch, dtype), batch, context, device)
            q = make_queries(phase, model, batch, context, getattr(torch, dtype), device)
            results[point] = median_ms({name: kernel(phase, c, q, context, name) for name, c in caches.items()},
                                       repeats)
            del caches
            bar.advance(task)
    ratios = {point: {"vattn/contiguous": ms["vattn"] / ms["contiguous"], "vattn/paged": ms["vattn"] / ms["paged"]}
              for point, ms in results.items()}
    print_table(f"attention kernel time on {device}, one layer (ms, median of {repeats})",
                ["phase", "dtype", "model", "batch", "context", *names, *GOALS],
                [[*point, *(ms[name] for name in names), *ratios[point].values()] for point, ms in results.items()])
    measured = {}
    for model in MODELS:
        r = ratios.get(("decode", "float32", model, 8, 2048))
        if r:
            measured[model] = {**r, "met": all(r[k] <= goal for k, goal in GOALS.items())}
            console.print(f"target, {model} fp32 decode batch 8 context 2048: "
                          + ", ".join(f"{k} {r[k]:.3f} (goal ≤ {goal})" for k, goal in GOALS.items())
                          + (" met" if measured[model]["met"] else " MISSED"))
    rows = [dict(phase=p, dtype=d, model=m, batch=b, context=c, layout=name, ms=ms[name])
            for (p, d, m, b, c), ms in results.items() for name in names]
    result = {"device": device, "rows": rows,
              "targets": {"phase": "decode", "dtype": "float32", "batch": 8, "context": 2048, "at_most": GOALS,
                          "measured": measured}}
    write_json(json_path, result)
    if plot_dir:
        for phase, dtype, model, batch in dict.fromkeys(point[:4] for point in results):
            curve = {c: ms for (*key, c), ms in results.items() if tuple(key) == (phase, dtype, model, batch)}
            line_chart(Path(plot_dir) / f"kernels_{phase}_{dtype}_{model}_b{batch}.png",
                       f"{phase} attention, one layer of {model}, {dtype}, batch {batch}", "context (tokens)",
                       "ms (median)", {name: (list(curve), [ms[name] for ms in curve.values()]) for name in names},
                       log_x=True)
    return result
