"""`vattn bench vmm`: what mapping pages costs on the host backend.

Per page, for each page size: the library's batched path (one call for many
pages), a single-page call per page, and a raw C loop of the same syscalls.
Virtual and physical pages are both taken in shuffled order, so no two pages
merge into one syscall and every path does exactly one mmap per page; the
contiguous figure (neighbouring pages, merged into one syscall) shows what
merging buys.  Then the mapping time per decode step of a cache
whose 64 requests grow by one token per step.

On CUDA (`--device cuda`): µs per call of `cuMemCreate`, `cuMemMap`,
`cuMemSetAccess` (one page, and one call over a run of pages) and
`cuMemUnmap` on pages of the driver's granularity, the backend's batched map
(map + one set-access per run) and unmap per page, and the mapping time per
decode step of the same 64 requests in the interleaved layout.
"""
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vattn.backends import HostBackend
from vattn.bench.shapes import SMOLLM2_135M
from vattn.config import CacheConfig
from vattn.kv.virtual import VirtualKVCache
from vattn.report import print_table, write_json

KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZES = {"64k": 64 * KiB, "256k": 256 * KiB, "2m": 2 * MiB}
SMOLLM2 = dict(SMOLLM2_135M.cache_fields(), dtype=torch.float16)


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

        raw_map, raw_unmap = backend.raw_map_loop(reservation, pool, offsets, pages)
        samples["raw_map"].append(raw_map)
        samples["raw_unmap"].append(raw_unmap)

        t0 = time.perf_counter_ns()
        backend.map(reservation, pool, range(0, num_pages * page_size, page_size), range(num_pages))
        samples["contiguous_map"].append(time.perf_counter_ns() - t0)
        backend.unmap(reservation, pool, offsets)
    return {k: statistics.median(v) / num_pages / 1e3 for k, v in samples.items()}


def cuda_latency(num_pages: int = 64, repeats: int = 15) -> dict:
    """Median µs per call (per page for the backend's batched calls)."""
    from vattn.backends import get_backend
    from vattn.backends.cuda import check, cuda_driver

    backend, driver = get_backend("cuda"), cuda_driver()
    size, n = backend.granularity, num_pages
    res = backend.reserve(n * size)
    pool = backend.create_pool(n, size)
    base, offsets = res.addr, [j * size for j in range(n)]
    samples = {k: [] for k in ("cuMemCreate", "cuMemMap", "cuMemSetAccess (one page)",
                               f"cuMemSetAccess ({n}-page run)", "cuMemUnmap", "backend map (per page)",
                               "backend unmap (per page)")}

    def timed(name, calls, per=1):
        t0 = time.perf_counter_ns()
        for call in calls:
            check(call(), name)
        samples[name].append((time.perf_counter_ns() - t0) / per / 1e3)

    for _ in range(repeats):
        handles = []
        t0 = time.perf_counter_ns()
        for _ in range(8):
            handles.append(check(driver.cuMemCreate(size, backend.allocation_prop, 0), "cuMemCreate"))
        samples["cuMemCreate"].append((time.perf_counter_ns() - t0) / 8 / 1e3)
        for h in handles:
            driver.cuMemRelease(h)
        timed("cuMemMap", [lambda j=j: driver.cuMemMap(base + j * size, size, 0, pool.handles[j], 0)
                           for j in range(n)], n)
        timed("cuMemSetAccess (one page)",
              [lambda j=j: driver.cuMemSetAccess(base + j * size, size, backend.access_descs, 1) for j in range(n)], n)
        timed(f"cuMemSetAccess ({n}-page run)",
              [lambda: driver.cuMemSetAccess(base, n * size, backend.access_descs, 1)])
        timed("cuMemUnmap", [lambda j=j: driver.cuMemUnmap(base + j * size, size) for j in range(n)], n)
        t0 = time.perf_counter_ns()
        backend.map(res, pool, offsets, range(n))
        t1 = time.perf_counter_ns()
        backend.unmap(res, pool, offsets)
        torch.cuda.synchronize(backend.device)
        res.settle()  # the unmaps themselves happen here, once the stream is done
        t2 = time.perf_counter_ns()
        samples["backend map (per page)"].append((t1 - t0) / n / 1e3)
        samples["backend unmap (per page)"].append((t2 - t1) / n / 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def while_a_kernel_runs(num_pages: int = 16, kernel_cycles: int = 1_000_000_000) -> dict:
    """µs per page of cuMemMap + cuMemSetAccess + cuMemUnmap at addresses no
    kernel reads, called while a long kernel runs, from this thread and from
    another (the mapping worker's premise: the driver does not wait for the
    GPU), and whether the kernel was still running when the calls returned."""
    from vattn.backends import get_backend
    from vattn.backends.cuda import check, cuda_driver

    backend, driver = get_backend("cuda"), cuda_driver()
    size = backend.granularity
    res, pool = backend.reserve(num_pages * size), backend.create_pool(num_pages, size)

    def cycle() -> float:
        backend.activate()
        t0 = time.perf_counter_ns()
        for j in range(num_pages):
            check(driver.cuMemMap(res.addr + j * size, size, 0, pool.handles[j], 0), "cuMemMap")
        check(driver.cuMemSetAccess(res.addr, num_pages * size, backend.access_descs, 1), "cuMemSetAccess")
        for j in range(num_pages):
            check(driver.cuMemUnmap(res.addr + j * size, size), "cuMemUnmap")
        return (time.perf_counter_ns() - t0) / num_pages / 1e3

    out = {}
    with ThreadPoolExecutor(1) as other:
        for where, calls in (("this thread", cycle), ("another thread", lambda: other.submit(cycle).result())):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(kernel_cycles)
            end.record()
            us = calls()
            running = not end.query()
            end.synchronize()
            out[where] = {"us_per_page": us, "kernel_still_running": running, "kernel_ms": start.elapsed_time(end)}
    res.close()
    return out


def decode_step_mapping(page_size: int, layout: str, requests: int, steps: int, seed: int = 0,
                        device: str = "cpu") -> dict:
    """Median and p99 µs of `grow_many` per decode step, 64 requests with
    ShareGPT-like prompt lengths each growing by one token per step."""
    config = CacheConfig(**SMOLLM2, max_num_seqs=requests, max_seq_len=2048, page_size=page_size, layout=layout,
                         device=device)
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


def run_cuda(json_path: str | None = None, repeats: int = 15, steps: int = 512) -> dict:
    from vattn.backends import get_backend

    latency = cuda_latency(repeats=repeats)
    busy = while_a_kernel_runs()
    page = get_backend("cuda").granularity
    step = decode_step_mapping(page, "interleaved", 64, steps, device="cuda")
    result = {"device": "cuda", "page_size": page, "us_per_call": latency, "while_a_kernel_runs": busy,
              "decode_step": {"interleaved": step}}
    print_table(f"CUDA VMM latency ({page >> 20} MiB pages, µs per call, median of {repeats} runs)",
                ["call", "µs"], [[k, v] for k, v in latency.items()])
    print_table("map + access + unmap while a kernel runs (µs per page)", ["from", "µs", "kernel still running",
                                                                            "kernel ms"],
                [[where, b["us_per_page"], b["kernel_still_running"], b["kernel_ms"]] for where, b in busy.items()])
    print_table(f"mapping time per decode step on CUDA: 64 requests × {steps} steps, SmolLM2 geometry (µs)",
                ["layout", "median", "mean", "p99", "steps that mapped"],
                [["interleaved", step["median_us"], step["mean_us"], step["p99_us"], step["steps_that_mapped"]]])
    write_json(json_path, result)
    return result


def run(json_path: str | None = None, repeats: int = 15, steps: int = 512, device: str = "cpu") -> dict:
    if device != "cpu":
        return run_cuda(json_path, repeats, steps)
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
