import json
import os
import subprocess
import sys

import torch

from vattn import CacheConfig
from vattn.bench.shapes import SMOLLM2_135M

KV_BYTES_PER_TOKEN = CacheConfig(**SMOLLM2_135M.cache_fields(), dtype=torch.float32).kv_bytes_per_token


def vattn(*args, timeout=300):
    out = subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_info():
    from vattn.backends.cuda import unavailable

    out = vattn("info")
    for field in ("host backend", "host (mmap + memfd)", "vm.max_map_count", "default page size", "torch",
                  "CUDA backend"):
        assert field in out
    why = unavailable()
    assert ("unavailable: " + why[:20] if why else "ready: ") in " ".join(out.split())
    assert "tensor parallelism" in out and "torch.distributed (gloo" in out


def test_each_benchmark_takes_and_lists_its_own_options():
    kernels, soak = vattn("bench", "kernels", "--help"), vattn("bench", "soak", "--help")
    assert "--contexts" in kernels and "--chaos" not in kernels and "--workload" not in kernels
    assert "--chaos" in soak and "--contexts" not in soak
    refused = subprocess.run([sys.executable, "-m", "vattn", "bench", "soak", "--contexts", "8"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode != 0 and "unrecognized arguments: --contexts" in refused.stderr


def test_the_demo_s_figures_fit_a_100_column_terminal():
    from rich.console import Console

    from vattn import report
    from vattn.demo import title
    from vattn.workload import figure_rows

    summary = {"mean": 41335.9, "median": 43491.6, "p99": 48543.4}
    figures = dict(requests=32, seconds=123.4, req_per_s=0.26, output_tok_per_s=85.5, ttft_ms=summary,
                   tpot_ms=summary, itl_ms=summary, e2el_ms=summary, kv_utilization=0.915, peak_pages=4096,
                   pages_total=4096, page_size=8192, num_buffers=180, layout="interleaved", preemptions=10000,
                   prefix_hit_rate=0.5, attention="triton", per_request_decodes=12345, step_ms_median=352.2,
                   decode_step_ms_median=271.0, map_ms_per_step=2.339, linear_gemms=121, linear_weight_bytes=513 << 20,
                   linear_bytes_held_twice=108 << 20, tensor_parallel_size=3,
                   kv_bytes_per_rank={"peak": 627 << 20, "budget": 5760 << 20}, broadcast_ms_per_step=1.5)
    rows = figure_rows(figures)
    narrow = Console(width=100, record=True)
    kept, report.console = report.console, narrow
    try:
        report.print_table(title(32, 3, "bfloat16"), ["", ""], rows)
    finally:
        report.console = kept
    lines = narrow.export_text().splitlines()
    assert len(lines) == len(rows) + 5  # title, borders, header: no row wrapped
    assert max(map(len, lines)) <= 100


def test_bench_vmm_writes_json(tmp_path):
    path = tmp_path / "vmm.json"
    out = vattn("bench", "vmm", "--repeats", "2", "--steps", "16", "--json", str(path))
    assert "map/unmap latency per page" in out and "mapping time per decode step" in out
    result = json.loads(path.read_text())
    for key in ("map_us_per_page", "unmap_us_per_page", "raw_map_us_per_page", "map_ratio_vs_raw"):
        assert set(result[key]) == {"64k", "256k", "2m"} and all(v > 0 for v in result[key].values())
    assert result["decode_step"]["interleaved"]["64k"]["steps_that_mapped"] > 0


def test_demo_serves_sharegpt_prompts(tmp_path):
    path = tmp_path / "demo.json"
    out = vattn("demo", "--num-prompts", "3", "--max-tokens", "4", "--show", "1", "--json", str(path))
    assert "request 0:" in out and "output tok/s" in out and "prefix-cache hit rate" in out
    assert "the KV pool: 1024 MiB in chunks of 32 MiB" in out and "smollm2" in out  # the split, while it holds
    held = [line.split("│")[4] for line in out.splitlines() if line.startswith("│ smollm2")]
    assert len(held) == 1 and float(held[0].replace(",", "")) >= 32  # it held its chunks when the table was made
    result = json.loads(path.read_text())
    assert result["requests"] == 3 and 3 <= result["output_tokens"] <= 12
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[key]) == {"mean", "median", "p99"}
    assert 0 < result["kv_utilization"] <= 1 and result["peak_pages"] > 0


def test_bench_engine_reports_medians_of_its_rounds(tmp_path):
    path = tmp_path / "engine.json"
    out = vattn("bench", "engine", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "2", "--json", str(path))
    out = " ".join(out.split())  # a title wider than its table wraps
    assert "medians of 2 runs" in out and "mapping ms per step without the worker" in out
    result = json.loads(path.read_text())
    runs = result["rounds"]["with_worker"]
    assert len(runs) == 2 and len(result["rounds"]["without_worker"]) == 2 and result["commit"]
    assert min(r["step_ms_median"] for r in runs) <= result["step_ms_median"] <= max(r["step_ms_median"] for r in runs)
    assert result["output_tokens"] == runs[0]["output_tokens"] and result["layout"] == "per_head"


def test_bench_sweep_runs_each_point_of_the_grid(tmp_path):
    path = tmp_path / "sweep.json"
    out = vattn("bench", "sweep", "--num-prompts", "3", "--max-tokens", "4", "--rounds", "2", "--max-num-seqs", "1",
                "2", "--max-num-batched-tokens", "64", "--max-running-tokens", "none", "--json", str(path))
    assert "engine sweep: 3 sharegpt requests" in " ".join(out.split())
    result = json.loads(path.read_text())
    rows = result["rows"]
    assert [(r["max_num_seqs"], r["max_num_batched_tokens"], r["max_running_tokens"]) for r in rows] == [
        (1, 64, None), (2, 64, None)]
    assert all(len(r["rounds"]) == 2 and r["output_tokens"] == rows[0]["output_tokens"] for r in rows)
    best = max(rows, key=lambda r: r["output_tok_per_s"])
    assert result["best"] == {"max_num_seqs": best["max_num_seqs"], "max_num_batched_tokens": 64,
                              "max_running_tokens": None}
    refused = subprocess.run([sys.executable, "-m", "vattn", "bench", "engine", "--max-num-seqs", "1", "2"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--max-num-seqs takes one value" in refused.stderr


def test_bench_soak_passes_on_a_few_requests(tmp_path):
    path = tmp_path / "soak.json"
    out = vattn("bench", "soak", "--requests", "40", "--chaos", "--json", str(path))
    assert "soak --chaos: 40 requests per preemption mode" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["recompute", "swap"]
    assert all(r["mismatches"] == r["lost"] == 0 and r["pool_whole"] and r["preemptions"] > 0 for r in rows)
    assert all(r["finished"] + r["errors"] + r["aborted"] + r["refused"] == 40 and r["poisoned"] == 4 for r in rows)


def test_bench_e2e_runs_every_system(tmp_path):
    """Two prompts through every system, vLLM's engine among them, all at once and at 8 requests/s."""
    from vattn import allocator
    from vattn.bench import peers

    assert peers.vllm_python() is not None, peers.HOW
    path = tmp_path / "e2e.json"
    out = vattn("bench", "e2e", "--num-prompts", "2", "--max-tokens", "6", "--rounds", "1", "--dtype", "float32",
                "--request-rate", "inf", "8", "--json", str(path), "--plot", str(tmp_path),
                timeout=900)  # vLLM compiles its model first: about 2 minutes of a 2-core AVX2 CPU uncached
    assert "end to end: 2 sharegpt requests" in out and "batch size sweep" in out
    assert "memory round: vattn" in out and "memory round: vllm_cpu" in out  # sampled apart from the timed rounds
    result = json.loads(path.read_text())
    assert result["commit"] and result["versions"]["vllm"] and result["request_rate"] == ["inf", 8.0]
    for rate in ("inf", 8.0):
        rows = {r["system"]: r for r in result["rows"] if r["request_rate"] == rate}
        assert set(rows) == {"vattn", "paged_16", "vllm_cpu", "hf_continuous_batching", "hf_static"}
        for r in rows.values():
            assert r["output_tok_per_s"] > 0 and r["req_per_s"] > 0 and set(r["ttft_ms"]) == {"mean", "median", "p99"}
            assert r["output_tokens"] == rows["vattn"]["output_tokens"]  # EOS ignored: every answer at its cap
            assert r["same_tokens_as_vattn"] == 2  # greedy float32: every system gives the same tokens
            assert r["peak_rss_bytes"] > 100 << 20 and 0 < r["kv_bytes_committed"] <= result["kv_budget_bytes"]
            assert 100 << 20 < r["peak_pss_bytes"] <= r["peak_rss_bytes"]
            assert len(r["rounds"]) == 1 and r["kv_budget_bytes"] == result["kv_budget_bytes"]
        for system in ("vattn", "paged_16"):  # at its busiest, KV for the longer prompt (at least half of them)
            assert rows[system]["kv_bytes_committed"] >= result["prompt_tokens"] // 2 * KV_BYTES_PER_TOKEN
        vattn_ran, vllm_ran = rows["vattn"]["settings"], rows["vllm_cpu"]["settings"]
        assert vattn_ran["options"]["memory_budget"] == vllm_ran["kv_cache_memory_bytes"] == result["kv_budget_bytes"]
        assert vattn_ran["dtype"] == vllm_ran["dtype"] == "float32"
        assert vattn_ran["torch_threads"] == os.cpu_count()
        assert vattn_ran["allocator"].startswith("tcmalloc" if allocator.TCMALLOC.exists() else "glibc")
        assert vllm_ran["omp_threads_bind"] == f"0-{os.cpu_count() - 1}"
        assert vllm_ran["reserved_cpus"] == "0" and not vllm_ran["enforce_eager"]
        assert "libiomp5.so" in vllm_ran["ld_preload"]  # as vLLM's CPU docs advise
        assert set(result["ratios"][str(rate)]) == {f"vattn_vs_{s}" for s in rows if s != "vattn"}
        assert set(result["memory_ratios"][str(rate)]) == set(result["ratios"][str(rate)])
        assert all(r["gflops_per_s"] == result["workload_flops"] / r["seconds"] / 1e9 for r in rows.values())
    assert {s["batch_size"] for s in result["static_sweep"]} == {8, 16, 32}
    assert result["gemm_peak_gflops"] > 10 and result["workload_flops"] > 0
    assert (tmp_path / "e2e_sharegpt_throughput_latency.png").stat().st_size > 0


def test_bench_memory_rejects_a_bad_budget():
    out = subprocess.run([sys.executable, "-m", "vattn", "bench", "memory", "--budget", "lots"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "'lots' is not a size" in out.stderr
