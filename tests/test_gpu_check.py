"""The GPU check's own logic, on the host: its exit status where there is no
GPU, and each part run in a process of its own — passed, skipped, failed or
timed out, with whatever the part started killed with it."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vattn.backends.cuda import unavailable
from vattn.bench import gpu

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = unavailable()


def answer(obj) -> str:
    return f"print('some output of the part'); import json; print(json.dumps({obj!r}))"


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is here: the check runs instead of refusing")
def test_the_check_exits_2_with_one_line_where_there_is_no_gpu():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHON": sys.executable})
    assert proc.returncode == gpu.NO_GPU, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines() == [f"vattn bench gpu needs a CUDA GPU: {NO_GPU}"]


def test_a_part_that_answers_passes_and_its_figures_are_kept():
    part = gpu.run_part([sys.executable, "-c", answer({"result": {"rows": [1, 2]}})], 30)
    assert part["status"] == "passed" and part["rows"] == [1, 2]


def test_a_part_that_reports_failures_fails():
    part = gpu.run_part([sys.executable, "-c", answer({"result": {"passed": 3, "failed": 1}})], 30)
    assert part["status"] == "failed"


def test_a_skipped_part_says_why():
    part = gpu.run_part([sys.executable, "-c", answer({"skipped": "pytest is not installed"})], 30)
    assert part == {"status": "skipped", "reason": "pytest is not installed", "seconds": part["seconds"]}


@pytest.mark.parametrize("code, message", [
    ("raise SystemExit(3)", "exited 3 without an answer"),
    ("import os; os.abort()", "without an answer"),
    (answer({"error": "RuntimeError: no"}), "RuntimeError: no"),
])
def test_a_part_that_crashes_or_errs_fails_with_the_reason(code, message):
    part = gpu.run_part([sys.executable, "-c", code], 30)
    assert part["status"] == "failed" and message in part["error"]


def test_a_part_past_its_time_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.perf_counter()
    part = gpu.run_part([sys.executable, "-c", code], 3)
    assert part["status"] == "timed out" and time.perf_counter() - start < 15
    child = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is here: the contract part passes")
def test_the_contract_part_without_a_gpu_fails_naming_why():
    part = gpu.run_part([sys.executable, "-m", "vattn.bench.gpu", "contract", json.dumps({})], 60)
    assert part["status"] == "failed" and "CudaUnavailable" in part["error"]


def test_the_summary_says_what_each_part_did():
    result = {"device": "a GPU", "torch": "2", "page_size": 2 << 20, "seconds": 9.0,
              "contract": {"status": "passed", "seconds": 1.0, "page_sizes": [2 << 20, 4 << 20]},
              "tests": {"status": "skipped", "reason": "pytest is not installed", "seconds": 0.1},
              "vmm": {"status": "timed out", "error": "no answer within 60 s", "seconds": 60.0},
              "kernels": {"status": "failed", "error": "exited 1 without an answer", "seconds": 2.0},
              "engine": {"status": "failed", "error": "RuntimeError: no", "seconds": 3.0}}
    rows = dict(map(tuple, gpu.summary_rows(result)))
    assert rows["contract"] == "passed in 1 s" and rows["backend contract"] == "held at pages of 2048 KiB, 4096 KiB"
    assert rows["tests"] == "skipped in 0 s: pytest is not installed"
    assert rows["vmm"] == "timed out in 60 s: no answer within 60 s"
    assert rows["kernels"].startswith("failed") and rows["engine"] == "failed in 3 s: RuntimeError: no"


def test_the_parts_fit_in_eight_minutes():
    assert sum(gpu.PARTS.values()) < 8 * 60


def test_the_engine_rows_compare_each_kernel_with_the_paged_cache_and_count_fallbacks():
    def run(tok_s, fallbacks):
        return {"output_tok_per_s": tok_s, "tpot_ms": {"median": 5.0}, "per_request_decodes": fallbacks,
                "map_ms_per_step": 0.1, "step_ms_median": 6.0}

    engine = {"model": "SmolLM2", "prompts": "ShareGPT", "num_prompts": 4, "same_tokens": {"virtual triton": 4,
                                                                                          "virtual sdpa": 3},
              "runs": {"virtual triton": run(300.0, 0), "virtual sdpa": run(100.0, 720),
                       "paged_gather": run(150.0, 0)}}
    rows = dict(map(tuple, gpu._engine_rows(engine)))
    assert rows["engine virtual triton: tok/s, TPOT ms median"] \
        == "300.0, 5.00 (2.00× paged_gather; same tokens as paged_gather: 4 of 4)"
    assert rows["engine virtual sdpa: layers decoded one call per request; mapping ms per step / median step ms"] \
        == "720; 0.100 / 6.00"
    assert rows["engine paged_gather: tok/s, TPOT ms median"] == "150.0, 5.00"


def test_the_vmm_rows_say_whether_mapping_waited_for_a_running_kernel():
    vmm = {"us_per_call": {"cuMemMap": 3.0}, "decode_step": {"interleaved": {"median_us": 5.0, "p99_us": 9.0}},
           "while_a_kernel_runs": {"this thread": {"us_per_page": 4.0, "kernel_still_running": True, "kernel_ms": 500},
                                   "another thread": {"us_per_page": 600.0, "kernel_still_running": False,
                                                      "kernel_ms": 500}}}
    rows = dict(map(tuple, gpu._vmm_rows(vmm)))
    assert rows["map + access + unmap µs per page while a kernel runs, from this thread"] \
        == "4.0 (before the 500 ms kernel ended)"
    assert rows["map + access + unmap µs per page while a kernel runs, from another thread"] \
        == "600.0 (not before the 500 ms kernel ended)"


def test_the_kernel_rows_give_each_point_its_floor_every_column_and_the_ratios():
    point = dict(phase="decode", model="SmolLM2-135M", batch=8, context=2048, lengths="uniform", floor_ms=0.01)
    ms = {"vattn": 0.04, "vattn_per_layer_triton": 0.02, "contiguous": 0.02, "paged_gather": 0.08}
    result = {"read_gb_per_s": 4000.0, "rows": [dict(point, layout=name, ms=t) for name, t in ms.items()],
              "sdpa_kernels": {"decode": ["fmha_cutlassF_bf16"], "prefill": []}}
    rows = dict(map(tuple, gpu._kernel_rows(result)))
    assert rows["SDPA decode kernels (flash / efficient / math pinned)"] == "fmha_cutlassF_bf16"
    assert rows["SDPA prefill kernels (flash / efficient / math pinned)"] == "none seen"
    [(where, times, ratios)] = gpu.kernel_ratios(result)
    assert where == "decode SmolLM2-135M b8 ctx2048 uniform (reading the live K/V at 4000 GB/s: 0.010)"
    assert times == "vattn 0.040 / vattn_per_layer_triton 0.020 / contiguous 0.020 / paged_gather 0.080"
    assert ratios == "2.00 / 0.50"


def test_the_cuda_kernel_bench_crosses_every_layout_with_every_installed_kernel():
    from vattn.bench import kernels

    names = kernels.layouts("cuda")
    assert names[0] == "vattn" and {"vattn_per_layer", "vattn_per_head", "contiguous", "paged_gather"} <= set(names)
    assert ("vattn_per_head_triton" in names) == ("triton" in kernels.INSTALLED)
    assert kernels.cuda_name("interleaved", "flash") == "vattn_flash"
    assert kernels.cuda_name("per_layer", "sdpa") == "vattn_per_layer"
