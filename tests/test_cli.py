import json
import subprocess
import sys


def vattn(*args):
    out = subprocess.run([sys.executable, "-m", "vattn", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_info():
    out = vattn("info")
    for field in ("backend", "host (mmap + memfd)", "vm.max_map_count", "default page size", "torch"):
        assert field in out


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
