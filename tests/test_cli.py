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
