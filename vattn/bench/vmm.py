"""`vattn bench vmm`: what mapping pages costs on the host backend.

Per page, for each page size: the library's batched path (one call for many
pages), a single-page call per page, and a raw C loop of the same syscalls.
Virtual and physical pages are both taken in shuffled order, so no two pages
merge into one syscall and every path does exactly one mmap per page; the
contiguous figure (neighbouring pages, merged into one syscall) shows what
merging buys.  Then the mapping time per decode step of a cache
whose 64 requests grow by one token per step.
"""
import random
import statistics
import time

import torch

from vattn import _native
from vattn.backends import HostBackend
from vattn.bench.report import print_table, write_json
from vattn.cache import VirtualKVCache
from vattn.config import CacheConfig

KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZES = {"64k": 64 * KiB, "256k": 256 * KiB, "2m": 2 * MiB}
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float16)


def per_page_latency(page_size: int, num_pages: int, repeats: int, seed: int = 0) -> dict:
    backend = HostBackend()
    reservation = backend.reserve(num_pages * page_size, zero_backed=True)
    pool = backend.create_pool(num_pages, page_size)
    rng = random.Random(seed)
    offsets = rng.sample(range(0, num_pages * page_size, page_size), num_pages)
    pages = rng.sample(range(num_pages), num_pages)
    samples = {k: [] for k in ("map", "unmap", "single_map", "single_unmap", "raw_map", "raw_unmap",
                               "contiguous_map")}
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        backend.map(reservation, pool, offsets, pages)
        t1 = time.perf_counter_ns()
        backend.unmap(reservation, pool, offsets)
        t2 = time.perf_counter_ns()
        samples["map"].append(t1 - t0)
        samples["unmap"].append(t2 - t1)

        t0 = time.perf_counter_ns()
        for o, p in zip(offsets, pages):
            backend.map(reservation, pool, [o], [p])
        t1 = time.perf_counter_ns()
        for o in offsets:
            backend.unmap(reservation, pool, [o])
        t2 = time.perf_counter_ns()
        samples["single_map"].append(t1 - t0)
        samples["single_unmap"].append(t2 - t1)

        raw_map, raw_unmap = _native.raw_map_loop(reservation, pool.file, page_size, offsets,
                                                  [p * page_size for p in pages])
        samples["raw_map"].append(raw_map)
        samples["raw_unmap"].append(raw_unmap)

        t0 = time.perf_counter_ns()
        backend.map(reservation, pool, range(0, num_pages * page_size, page_size), range(num_pages))
        samples["contiguous_map"].append(time.perf_counter_ns() - t0)
        backend.unmap(reservation, pool, offsets)
    return {k: statistics.median(v) / num_pages / 1e3 for k, v in samples.items()}


def decode_step_mapping(page_size: int, layout: str, requests: int, steps: int, seed: int = 0) -> dict:
    """Median and p99 µs of `grow_many` per decode step, 64 requests with
    ShareGPT-like prompt lengths each growing by one token per step."""
    config = CacheConfig(**SMOLLM2, max_batch=requests, max_seq_len=2048, page_size=page_size, layout=layout)
    cache = VirtualKVCache(config)
    rng = random.Random(seed)
    lengths = {}
    for _ in range(requests):
        n = rng.randint(16, 1024)
        lengths[cache.allocate(n)] = n
    times, mapping_steps = [], 0
    for _ in range(steps):
        lengths = {s: n + 1 for s, n in lengths.items()}
        calls = cache.map_calls
        t0 = time.perf_counter_ns()
        assert cache.grow_many(lengths)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        mapping_steps += cache.map_calls > calls
    times.sort()
    return {"median_us": statistics.median(times), "mean_us": statistics.fmean(times),
            "p99_us": times[int(0.99 * (len(times) - 1))], "steps_that_mapped": mapping_steps, "steps": steps}


def run(json_path: str | None = None, repeats: int = 15, steps: int = 512) -> dict:
    latency = {}
    for name, size in PAGE_SIZES.items():
        latency[name] = per_page_latency(size, num_pages=512 if size <= 256 * KiB else 256, repeats=repeats)
    result = {
        "map_us_per_page": {k: v["map"] for k, v in latency.items()},
        "unmap_us_per_page": {k: v["unmap"] for k, v in latency.items()},
        "single_map_us_per_page": {k: v["single_map"] for k, v in latency.items()},
        "single_unmap_us_per_page": {k: v["single_unmap"] for k, v in latency.items()},
        "raw_map_us_per_page": {k: v["raw_map"] for k, v in latency.items()},
        "raw_unmap_us_per_page": {k: v["raw_unmap"] for k, v in latency.items()},
        "contiguous_map_us_per_page": {k: v["contiguous_map"] for k, v in latency.items()},
        "map_ratio_vs_raw": {k: v["map"] / v["raw_map"] for k, v in latency.items()},
        "unmap_ratio_vs_raw": {k: v["unmap"] / v["raw_unmap"] for k, v in latency.items()},
        "decode_step": {layout: {name: decode_step_mapping(PAGE_SIZES[name], layout, 64, steps)
                                 for name in ("64k", "2m")}
                        for layout in ("per_layer", "per_head", "interleaved")},
    }
    print_table(f"map/unmap latency per page (µs, median of {repeats} runs; shuffled pages)",
                ["page", "batched map", "single-page map", "raw C map", "map vs raw", "batched unmap",
                 "raw C unmap", "unmap vs raw", "contiguous map"],
                [[k, v["map"], v["single_map"], v["raw_map"], result["map_ratio_vs_raw"][k], v["unmap"],
                  v["raw_unmap"], result["unmap_ratio_vs_raw"][k], v["contiguous_map"]]
                 for k, v in latency.items()])
    print_table(f"mapping time per decode step: 64 requests × {steps} steps, SmolLM2 geometry (µs)",
                ["layout / page", "median", "mean", "p99", "steps that mapped"],
                [[f"{layout} / {name}", d["median_us"], d["mean_us"], d["p99_us"], d["steps_that_mapped"]]
                 for layout, by_size in result["decode_step"].items() for name, d in by_size.items()])
    write_json(json_path, result)
    return result
