import json
import subprocess
import sys


def vattn(*args):
    out = subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, timeout=300)
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
    result = json.loads(path.read_text())
    assert result["requests"] == 3 and 3 <= result["output_tokens"] <= 12
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(result[key]) == {"mean", "median", "p99"}
    assert 0 < result["kv_utilization"] <= 1 and result["peak_pages"] > 0


def test_bench_soak_passes_on_a_few_requests(tmp_path):
    path = tmp_path / "soak.json"
    out = vattn("bench", "soak", "--requests", "40", "--json", str(path))
    assert "soak: 40 requests per preemption mode" in out
    rows = json.loads(path.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["recompute", "swap"]
    assert all(r["mismatches"] == 0 and r["pool_whole"] and r["preemptions"] > 0 for r in rows)


def test_bench_e2e_runs_every_system(tmp_path):
    path = tmp_path / "e2e.json"
    out = vattn("bench", "e2e", "--num-prompts", "3", "--max-tokens", "4", "--json", str(path), "--plot", str(tmp_path))
    assert "end to end: 3 ShareGPT prompts" in out
    result = json.loads(path.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"vattn", "paged_16", "hf_continuous_batching", "hf_static"}
    for r in rows.values():
        assert r["output_tok_per_s"] > 0 and r["req_per_s"] > 0 and set(r["ttft_ms"]) == {"mean", "median", "p99"}
        assert r["same_tokens_as_vattn"] == 3  # greedy float32: every system gives the same tokens
    assert set(result["targets"]) == {f"vattn_vs_{s}" for s in rows if s != "vattn"}
    assert (tmp_path / "e2e_throughput_latency.png").stat().st_size > 0


def test_bench_memory_rejects_a_bad_budget():
    out = subprocess.run([sys.executable, "-m", "vattn", "bench", "memory", "--budget", "lots"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "cannot read 'lots' as bytes" in out.stderr
