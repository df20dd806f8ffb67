"""`vattn bench kernels`: attention over KV layouts holding the same K/V, and
vLLM's CPU paged attention kernel over its own block pool.

- `vattn`: a `VirtualKVCache` with the engine's default layout and page size
  for the device (`per_head`, 8 KiB on the host), read by SDPA through
  `KVData.rows` (zero-copy strided views);
- `vattn_native` (host only): the same cache read in place by vattn's own
  kernel (`vattn.attention.native`, the engine's default on the host), one
  call for all of a point's requests, each reading its own rows;
- `vattn_interleaved` (host only; the engine's CUDA layout already is): the
  same cache in the `interleaved` layout, where a token's K/V of every layer
  lie side by side, so one layer's rows are strided by all layers' bytes;
- `contiguous`: ordinary `[B, H_kv, L, D]` tensors, the layout SDPA reads best;
- `paged_gather`: a `PagedKVCache` with the engine's block size, whose
  `KVData.rows` gathers through the block tables into a reused buffer (the
  engine's paged baseline: gather + SDPA, the gather timed);
- `vllm_paged` (host only, one column per block size, 16 and 128 — vLLM's CPU
  default): vLLM's own CPU kernel `cpu_attention_with_kv_cache` over blocks
  written by `cpu_attn_reshape_and_cache`, scattered through the pool as after
  churn.  vattn never imports vLLM: the peer script `vllm_kernels.py` measures
  it in the peer environment (`peers.py`), fed the same points, and its output
  is checked against SDPA over the same K/V (`max_abs_err`, within
  `TOLERANCE` or the run fails).  Without that environment the bench says
  how to make it and runs the other layouts.

The vattn layouts run the engine's own kernels (`vattn.attention`) on layer 0
of a model's GQA shape, reading K/V through `KVData.rows` inside the timed call.
The virtual caches have the model's real layer count, which sets the
interleaved layout's strides; only layer 0 is written (on the host, pages
mapped but never touched cost no memory; on CUDA every layer's are
committed).  The contiguous and paged caches hold layer 0 alone: no layer
count changes how it lies there.  Cases: decode, one token for each of B requests in
one batched `decode` call, every request at `context` tokens (`uniform`) or
at seeded lengths from context/32 to context (`mixed`, at the largest batch:
64–2048 at context 2048; the engine's batched call reads every row up to the
longest, masked); prefill with history, for each of B requests a causal
chunk of the engine's `max_num_batched_tokens` (256, or the whole context if
shorter) ending at `context`, one `prefill` call per chunk as the engine does
(vLLM: one call for all chunks, as its engine does).  What an engine builds
once per step for all layers (the decode mask, the paged gather index, vLLM's
scheduler metadata) is built before timing.  The layouts take turns within
each repeat (vLLM's block sizes among themselves, in its own process after
the others), so load elsewhere hits them alike, and before each timed call
`SCRUB_BYTES` of other memory are read (in vLLM's process too): every call
finds its K/V out of the caches, as an engine's attention does, each layer's
K/V read after every other layer's; each figure is the median of `repeats`
runs after a warm-up run, with every thread torch has (vLLM's too).

Every row carries its bandwidth floor `floor_ms`: the live K/V bytes the
call must read (each request's tokens of one layer) at this machine's read
bandwidth, measured once a run (`read_gb_per_s`: the median time of summing
1 GiB of float32); the table shows each time with its multiple of the floor.

On CUDA (`--device cuda`) the caches live on the GPU, with pages of the
driver's granularity, each call timed by CUDA events around it, and the
virtual cache comes in each of `CUDA_LAYOUTS` (`vattn` is the engine's
default, interleaved; `vattn_per_layer`, `vattn_per_head`) under each CUDA
kernel installed: SDPA, the Triton decode kernel (`_triton`: its decode; its
prefill is SDPA's) and, with flash-attn, `flash_attn_with_kvcache` (`_flash`),
also over a contiguous `[B, L, H_kv, D]` cache (`contiguous_flash`) and
through the block tables of a `PagedKVCache` of 256-token blocks
(`paged_flash`).  A layer-interleaved layout strides one layer's rows by
every layer's bytes, which costs a kernel TLB reach: these columns decide
the CUDA default.

Thinned grid: prefill runs at the smallest batch only (a forward holds at most
one 256-token chunk, and B chunks are B calls: B times the time, the same
ratios), and dtypes other than float32 skip the largest batch × context of
each case (the costliest point, with the ratios of its neighbours).
"""
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from rich.progress import Progress

import vattn.attention.flash as flash
import vattn.attention.triton_decode as triton_decode
import vattn.binding as binding
from vattn.attention.batch import StepBatch
from vattn.attention.registry import INSTALLED
from vattn.attention.sdpa import SdpaStep, backends, prefill
from vattn.bench import peers
from vattn.bench.plots import line_chart
from vattn.bench.shapes import LLAMA_3_8B, SMOLLM2_135M
from vattn.report import console, print_table, write_json
from vattn.kv.virtual import VirtualKVCache
from vattn.config import CacheConfig, resolve
from vattn.engine import EngineConfig
from vattn.kv.paged import PagedKVCache

MODELS = {"SmolLM2-135M": SMOLLM2_135M, "Llama-3-8B": LLAMA_3_8B}
LAYOUTS = ("vattn", "vattn_native", "vattn_interleaved", "contiguous", "paged_gather")
CUDA_LAYOUTS = ("interleaved", "per_layer", "per_head")  # the engine's CUDA default first
VLLM, BLOCK_SIZES = "vllm_paged", (16, 128)
GOALS = {"vattn/contiguous": 1.05, "vattn/paged_gather": 0.6}  # at most: float32 decode, batch 8, context 2048
# vattn_native at most these times vLLM's kernel (its faster block size) and the bandwidth floor, float32 decode
NATIVE_GOALS = {("Llama-3-8B", 32, "mixed"): {"vllm": 0.7}, ("Llama-3-8B", 8, "uniform"): {"vllm": 0.8, "floor": 1.5},
                ("SmolLM2-135M", 32, "mixed"): {"vllm": 0.8}, ("SmolLM2-135M", 8, "uniform"): {"vllm": 0.8}}
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # vllm_paged's max |out - SDPA in float32|
READ_BYTES = 1 << 30  # summed to measure the read bandwidth
SCRUB_BYTES = 64 << 20  # read before each timed call: more than this CPU's last-level cache (32 MiB)


class Point(NamedTuple):
    """What one measurement is of, as rows name it."""

    phase: str  # "decode" | "prefill"
    dtype: str
    model: str
    batch: int
    context: int
    lengths: str  # "uniform" | "mixed"


KEY = Point._fields


class Contiguous:
    """`[B, H_kv, L, D]` K and V behind the `rows` the kernels read (zeros
    past each request's length, as the virtual cache reads there): its own
    data plane, as SDPA reads one."""

    def __init__(self, config: CacheConfig):
        shape = (config.max_num_seqs, config.num_kv_heads, config.max_seq_len, config.head_dim)
        self.config, self.device = config, torch.device(config.device)
        self.k, self.v = (torch.zeros(shape, dtype=config.dtype, device=config.device) for _ in "kv")

    def rows(self, layer: int, lo: int, hi: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[lo:hi, :, :length].transpose(1, 2), self.v[lo:hi, :, :length].transpose(1, 2)

    def readable(self, lo: int, hi: int, length: int) -> bool:
        return True


def layouts(device: str) -> tuple[str, ...]:
    """The layouts measured in this process."""
    if device == "cpu":
        return LAYOUTS
    kernels = ["sdpa"] + (["triton"] if "triton" in INSTALLED else []) + (["flash"] if flash.AVAILABLE else [])
    return (*(cuda_name(layout, k) for layout in CUDA_LAYOUTS for k in kernels), "contiguous", "paged_gather",
            *(["contiguous_flash", "paged_flash"] if flash.AVAILABLE else []))


def cuda_name(layout: str, kernel: str) -> str:
    """The column of the virtual cache in `layout` under `kernel` on CUDA."""
    return "vattn" + ("" if layout == CUDA_LAYOUTS[0] else f"_{layout}") + ("" if kernel == "sdpa" else f"_{kernel}")


def request_lengths(kind: str, batch: int, context: int, seed: int = 0) -> list[int]:
    """Tokens of each request: all `context` (`uniform`) or seeded from context/32 to context (`mixed`)."""
    if kind == "uniform":
        return [context] * batch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, context // 32), context + 1, (batch,), generator=g).tolist()


def query_tokens(phase: str, context: int) -> int:
    return 1 if phase == "decode" else min(EngineConfig().max_num_batched_tokens, context)


def make_layouts(model: str, dtype: torch.dtype, lengths: list[int], device: str = "cpu", seed: int = 0) -> dict:
    """The layouts of `layouts(device)`, each holding the same random K/V (layer 0) of requests of `lengths` tokens."""
    engine = EngineConfig()
    shape = MODELS[model]
    Hkv, D = shape.kv_heads, shape.head_dim
    base = CacheConfig(shape.layers, Hkv, D, dtype, max_num_seqs=len(lengths), max_seq_len=max(lengths),
                       page_size=engine.page_size, layout=engine.layout, device=device)
    config = resolve(base)
    layer0 = dataclasses.replace(config, num_layers=1, memory_budget=None)
    names = layouts(device)
    virtual = ({"vattn": config.layout, "vattn_interleaved": "interleaved"} if device == "cpu"
               else {cuda_name(layout, "sdpa"): layout for layout in CUDA_LAYOUTS})
    # each layout resolved on its own: its pages, and so the budget that holds every request, differ
    caches = {name: VirtualKVCache(resolve(dataclasses.replace(base, layout=layout))) for name, layout in virtual.items()}
    caches |= {"contiguous": Contiguous(layer0), "paged_gather": PagedKVCache(layer0, block_size=engine.block_size)}
    if "paged_flash" in names:
        caches["paged_flash"] = PagedKVCache(layer0, block_size=flash.BLOCK_MULTIPLE)
    g = torch.Generator().manual_seed(seed)
    for slot, length in enumerate(lengths):
        k, v = (torch.randn(1, length, Hkv, D, generator=g).to(dtype).to(device) for _ in "kv")
        contiguous = caches["contiguous"]
        contiguous.k[slot, :, :length], contiguous.v[slot, :, :length] = k[0].transpose(0, 1), v[0].transpose(0, 1)
        for cache in caches.values():
            if cache is not contiguous:
                assert cache.allocate(length) == slot
                cache.data.write(0, [slot], [0], k, v)
    for name in names:  # a kernel over another column's cache
        if name == "contiguous_flash":
            caches[name] = caches["contiguous"].k.transpose(1, 2), caches["contiguous"].v.transpose(1, 2)
        elif name not in caches:
            caches[name] = caches[name.rsplit("_", 1)[0]]
    return {name: caches[name] for name in names}


def make_queries(phase: str, model: str, batch: int, context: int, dtype: torch.dtype, device: str = "cpu",
                 seed: int = 1) -> torch.Tensor:
    """Decode: `[B, H, D]`, one token per request; prefill: `[B, n, H, D]`, each request's last n tokens."""
    H, D = MODELS[model].heads, MODELS[model].head_dim
    n = query_tokens(phase, context)
    q = torch.randn(batch, n, H, D, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    return q[:, 0] if phase == "decode" else q


def kernel(phase: str, cache, q: torch.Tensor, lengths: list[int], name: str = "vattn"):
    """A call running `phase` attention of `q` over `cache` (layer 0), request i
    holding `lengths[i]` tokens (its query the last of them), returning its
    output: the engine's kernels, or for the `*_flash` layouts
    `flash_attn_with_kvcache` over the same K/V."""
    B, scale = q.shape[0], q.shape[-1] ** -0.5
    if name.endswith("_flash"):
        return _flash_kernel(phase, cache, q, lengths, name)
    if name == "vattn_native":
        return _native_kernel(cache, q, lengths)
    if name.endswith("_triton") and phase == "decode":
        K, V = cache.data.views(0)
        slots = torch.arange(B, dtype=torch.int32, device=q.device)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
        return lambda: triton_decode.decode(q, K, V, slots, seqlens, scale, checked=True)  # as the engine calls it
    data = cache if isinstance(cache, Contiguous) else cache.data
    if phase == "decode":  # its masks made by the first call, as in a step's first layer
        step = SdpaStep(StepBatch(list(range(B)), [length - 1 for length in lengths], []), data)
        return lambda: step.decode(0, q, scale, None)
    n = q.shape[1]
    return lambda: torch.stack([prefill(q[i], *(t[0] for t in data.rows(0, i, i + 1, length)), length - n, scale,
                                        None) for i, length in enumerate(lengths)])


def _native_kernel(cache, q: torch.Tensor, lengths: list[int]):
    """One native call for every request (decode `q [B, H, D]`, prefill `[B, n, H, D]`)."""
    n = 1 if q.dim() == 3 else q.shape[1]
    flat = q.reshape(-1, *q.shape[-2:])
    table = binding.request_table((i, 0, length, i * n, n) for i, length in enumerate(lengths))
    K, V = cache.data.views(0)
    return lambda: binding.attend(flat, K, V, table, q.shape[-1] ** -0.5).view(q.shape)


def _flash_kernel(phase: str, cache, q: torch.Tensor, lengths: list[int], name: str):
    """`flash_attn_with_kvcache` reading each request's tokens (the query's
    own K/V among them, so nothing is appended)."""
    B, n = q.shape[0], 1 if phase == "decode" else q.shape[1]
    q = q[:, None] if phase == "decode" else q
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    if name == "paged_flash":  # through the block tables
        K, V = cache.data.views(0)
        where = {"block_table": torch.tensor(cache.data.block_tables(list(range(B))), dtype=torch.int32,
                                             device=q.device)}
    else:
        K, V = cache if name == "contiguous_flash" else cache.data.views(0)
        where = {"cache_batch_idx": torch.arange(B, dtype=torch.int32, device=q.device)}
    return lambda: flash.flash_attn_with_kvcache(q, K, V, cache_seqlens=seqlens, softmax_scale=q.shape[-1] ** -0.5,
                                                     causal=n > 1, **where)


def median_ms(calls: dict, repeats: int, device: str = "cpu") -> dict[str, float]:
    """Median ms of each call, the calls taking turns after a warm-up run of
    each, each timed after `SCRUB_BYTES` of memory are read (on the host, or
    on CUDA the device, where CUDA events around the call time it)."""
    samples = {name: [] for name in calls}
    for call in calls.values():
        call()
    cuda = device != "cpu"
    if cuda:
        torch.cuda.synchronize(device)
    scrub = torch.ones(SCRUB_BYTES // 4, device=device)
    for _ in range(repeats):
        for name, call in calls.items():
            scrub.sum()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def cuda_kernels(call) -> list[str]:
    """The names of the CUDA kernels one run of `call` launches (which SDPA
    backend ran, under the engine's pin)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def read_gb_per_s(device: str, repeats: int) -> float:
    """The read bandwidth kernels can reach here: 1 GiB of float32 summed
    with every thread (the median of `repeats`), in GB/s."""
    x = torch.ones(READ_BYTES // 4, device=device)
    return READ_BYTES / median_ms({"sum": x.sum}, max(repeats, 5), device)["sum"] / 1e6


def floor_ms(model: str, dtype: str, lengths: list[int], gb_per_s: float) -> float:
    """The time reading the live K/V of layer 0 takes at `gb_per_s`."""
    Hkv, D = MODELS[model].kv_heads, MODELS[model].head_dim
    return sum(lengths) * 2 * Hkv * D * getattr(torch, dtype).itemsize / gb_per_s / 1e6


def grid(batches: list[int], contexts: list[int], dtypes: list[str]) -> list[Point]:
    """The points to measure, thinned as the module says."""
    points = []
    cases = {("decode", "uniform"): [(b, c) for b in batches for c in contexts],
             ("decode", "mixed"): [(max(batches), c) for c in contexts] if max(batches) > 1 else [],
             ("prefill", "uniform"): [(min(batches), c) for c in contexts]}
    for (phase, lengths), sizes in cases.items():
        largest = max(sizes, key=lambda s: s[0] * s[1]) if len(sizes) > 1 else None
        points += [Point(phase, dtype, model, b, c, lengths) for dtype in dtypes for model in MODELS for b, c in sizes
                   if dtype == "float32" or (b, c) != largest]
    return points


def vllm_paged(points: list[Point], repeats: int, progress: Progress | None = None) -> dict | None:
    """vLLM's kernel at each point, by the peer script `vllm_kernels.py`:
    `{"vllm", "torch", "threads", "isa", "results"}`, results[i] being
    point i's `[{"block_size", "ms", "max_abs_err"}]`; None (said once) where
    the peer environment is missing."""
    if peers.vllm_python() is None:
        console.print(f"vllm_paged not measured: {peers.HOW}")
        return None
    task = progress.add_task("vLLM's paged attention (peer process)", total=len(points)) if progress else None
    specs = [dict(phase=p.phase, dtype=p.dtype, heads=MODELS[p.model].heads, kv_heads=MODELS[p.model].kv_heads,
                  head_dim=MODELS[p.model].head_dim, lengths=request_lengths(p.lengths, p.batch, p.context),
                  query_tokens=query_tokens(p.phase, p.context)) for p in points]
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "points.json", Path(tmp) / "ms.json"
        spec.write_text(json.dumps({"points": specs, "block_sizes": BLOCK_SIZES, "repeats": repeats,
                                    "threads": torch.get_num_threads()}))
        proc = peers.popen([str(peers.script("vllm_kernels")), str(spec), str(out)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        log = []
        for line in proc.stdout:  # one line per point done, among vLLM's own
            log.append(line)
            if task is not None and line.startswith("vllm_kernels: point"):
                progress.advance(task)
        if proc.wait():
            raise RuntimeError(f"vllm_kernels.py failed (exit {proc.returncode}):\n{''.join(log[-40:])}")
        result = json.loads(out.read_text())
    for point, measured in zip(points, result["results"], strict=True):
        check(point, measured)
    return result


def check(point: Point, measured: list[dict]) -> None:
    """Fail loudly where vLLM's output is off the reference."""
    for m in measured:
        if not m["max_abs_err"] <= TOLERANCE[point.dtype]:  # NaN fails too
            raise AssertionError(f"vllm_paged block {m['block_size']} at {point}: max_abs_err {m['max_abs_err']:.3g} "
                                 f"> {TOLERANCE[point.dtype]} against SDPA over the same K/V")


def column(row: dict) -> str:
    """A row's column in the table and line in the plots."""
    return f"{VLLM} {row['block_size']}" if row["layout"] == VLLM else row["layout"]


def run(json_path: str | None, plot_dir: str | None, batches: list[int] = [1, 8, 32],
        contexts: list[int] = [512, 2048, 8192], dtypes: list[str] = ["float32", "bfloat16"],
        repeats: int = 15, device: str = "cpu") -> dict:
    points = grid(batches, contexts, dtypes)
    lengths = {p: request_lengths(p.lengths, p.batch, p.context) for p in points}
    gb_per_s = read_gb_per_s(device, repeats)
    floors = {p: floor_ms(p.model, p.dtype, lengths[p], gb_per_s) for p in points}
    rows, sdpa_ran = [], {}
    with Progress(console=console, transient=True) as bar, torch.inference_mode(), backends(torch.device(device)):
        task = bar.add_task("attention kernels", total=len(points))
        for point in points:
            phase, dtype, model, batch, context, kind = point
            bar.update(task, description=f"{phase} {dtype} {model} batch {batch} context {context} {kind}")
            caches = make_layouts(model, getattr(torch, dtype), lengths[point], device)
            q = make_queries(phase, model, batch, context, getattr(torch, dtype), device)
            calls = {name: kernel(phase, c, q, lengths[point], name) for name, c in caches.items()}
            if device != "cpu" and phase not in sdpa_ran:
                sdpa_ran[phase] = cuda_kernels(calls["vattn"])
            ms = median_ms(calls, repeats, device)
            rows += [dict(point._asdict(), layout=name, ms=t, floor_ms=floors[point]) for name, t in ms.items()]
            del caches, calls  # the calls hold the caches: both let go before the next point maps its own
            bar.advance(task)
        peer = vllm_paged(points, repeats, bar) if device == "cpu" else None
    for point, measured in zip(points, peer["results"] if peer else []):
        rows += [dict(point._asdict(), layout=VLLM, ms=m["ms"], floor_ms=floors[point], block_size=m["block_size"],
                      max_abs_err=m["max_abs_err"]) for m in measured]
    by_point = {point: {} for point in points}  # point -> {column: ms}
    for row in rows:
        by_point[Point(*(row[k] for k in KEY))][column(row)] = row["ms"]
    columns = list(dict.fromkeys(column(row) for row in rows))
    mine = ["vattn"] + (["vattn_native"] if "vattn_native" in columns else [])
    against = [*GOALS, *(f"{m}/{c}" for m in mine for c in columns if c.startswith(VLLM))]
    ratios = {point: {r: by[r.split("/")[0]] / by[r.split("/")[1]] for r in against} for point, by in by_point.items()}
    print_table(f"attention kernel time on {device}, layer 0 (ms, median of {repeats}; ×: multiple of the bandwidth "
                f"floor, the live K/V read at {gb_per_s:.1f} GB/s)", [*KEY, "floor ms", *columns, *against],
                [[*point, floors[point], *(f"{_ms(by[c])} ×{by[c] / floors[point]:.1f}" for c in columns),
                  *ratios[point].values()] for point, by in by_point.items()])
    targets = {}
    for model in MODELS:
        r = ratios.get(("decode", "float32", model, 8, 2048, "uniform"))
        if r:
            targets[model] = {**r, "met": all(r[k] <= goal for k, goal in GOALS.items())}
            console.print(f"target, {model} fp32 decode batch 8 context 2048: "
                          + ", ".join(f"{k} {r[k]:.3f} (goal ≤ {goal})" for k, goal in GOALS.items())
                          + (" met" if targets[model]["met"] else " MISSED"))
    native_targets = native_goals(by_point, floors)
    for t in native_targets:
        console.print(f"target, vattn_native {t['model']} fp32 decode batch {t['batch']} {t['lengths']} context 2048: "
                      + ", ".join(f"{k} {t['measured'][k]:.3f} (goal ≤ {t['at_most'][k]})" for k in t["at_most"])
                      + (" met" if t["met"] else " MISSED"))
    for phase, names in sdpa_ran.items():
        console.print(f"SDPA's {phase} on {device} ran: {', '.join(names)}")
    result = {"device": device, "torch": torch.__version__, "read_gb_per_s": gb_per_s, "sdpa_kernels": sdpa_ran,
              "threads": {"vattn": torch.get_num_threads(), **({VLLM: peer["threads"]} if peer else {})},
              "vllm": {k: peer[k] for k in ("vllm", "torch", "isa")} if peer else None, "rows": rows,
              "targets": {"phase": "decode", "dtype": "float32", "batch": 8, "context": 2048, "lengths": "uniform",
                          "at_most": GOALS, "measured": targets}, "native_targets": native_targets}
    write_json(json_path, result)
    if plot_dir:
        _plot(Path(plot_dir), by_point, floors, columns)
    return result


def native_goals(by_point: dict, floors: dict) -> list[dict]:
    """`NATIVE_GOALS` where this run measured them: vattn_native over the
    faster vllm_paged block size and over the bandwidth floor."""
    out = []
    for (model, batch, kind), goals in NATIVE_GOALS.items():
        point = Point("decode", "float32", model, batch, 2048, kind)
        by = by_point.get(point, {})
        vllm = [ms for c, ms in by.items() if c.startswith(VLLM)]
        if "vattn_native" not in by or ("vllm" in goals and not vllm):
            continue
        measured = {"vllm": by["vattn_native"] / min(vllm) if vllm else None,
                    "floor": by["vattn_native"] / floors[point]}
        measured = {k: measured[k] for k in goals}
        out.append(dict(model=model, batch=batch, lengths=kind, at_most=goals, measured=measured,
                        met=all(measured[k] <= goal for k, goal in goals.items())))
    return out


def _ms(ms: float) -> str:
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _plot(plot_dir: Path, by_point: dict, floors: dict, columns: list[str]) -> None:
    """Kernel time against context, a line per layout and one for the bandwidth floor, per case."""
    cases = {}  # (phase, dtype, model, batch, lengths) -> its points, one per context
    for point in by_point:
        cases.setdefault(point._replace(context=None), []).append(point)
    for (phase, dtype, model, batch, _, kind), points in cases.items():
        x = [point.context for point in points]
        series = {c: (x, [by_point[point][c] for point in points]) for c in columns}
        series["bandwidth floor"] = x, [floors[point] for point in points]
        mixed = kind == "mixed"
        line_chart(plot_dir / f"kernels_{phase}_{dtype}_{model}_b{batch}{'_mixed' if mixed else ''}.png",
                   f"{phase} attention, layer 0 of {model}, {dtype}, batch {batch}"
                   + (", lengths context/32 to context" if mixed else ""), "context (tokens)", "ms (median)",
                   series, log_x=True, log_y=True, dashed={"bandwidth floor"})
