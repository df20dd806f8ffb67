"""`vattn bench linears`: one forward's worth of SmolLM2-135M's GEMMs (each
layer's fused Q/K/V, O, fused gate/up and down, as the engine serves them,
then the tied LM head), at the rows of decode steps and of prefill chunks,
by each GEMM a CPU engine could run:

- `vattn`: vattn's own (`vattn.executor.gemm`, the engine's default for
  float32 where the CPU has AVX-512), weights packed in panels;
- `onednn`: torch's oneDNN linear over weights pre-packed for it (what the
  engine runs elsewhere, and inductor's freezing packs);
- `torch`: plain `F.linear` over the weights as they are (MKL's sgemm);
- `vllm`: vLLM's CPU linear, `onednn_mm` over the handler its CPU backend
  makes for each weight (`dispatch_cpu_unquantized_gemm`), measured by the
  peer script `vllm_linears.py` in the peer environment (`peers.py`).

Weights are seeded random of the real shapes in the run's dtype (speed does
not depend on their values), about 540 MB in float32 and half that in
bfloat16, so a pass reads every weight from memory once, as a forward does.
Figures are medians of `repeats` passes after a warm-up pass, vattn's,
oneDNN's and torch's taking turns (vLLM's after them, in its own process);
GFLOP/s count 2·rows·n·k per GEMM.
"""
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vattn.bench import peers
from vattn.bench.shapes import SMOLLM2_135M_CONFIG
import vattn.executor.gemm as gemm
from vattn.report import console, print_table, write_json

ROWS = (1, 8, 32, 48, 64, 128, 512)
# vLLM's output against float64, weights of 0.02 and inputs of 1: float32 sums; a bfloat16 output's rounding
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def shapes(config: dict = SMOLLM2_135M_CONFIG) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """(a layer's GEMMs as (out, in), the number of layers, the LM head's)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    layer = [(qkv, hidden), (hidden, config["num_attention_heads"] * head_dim), (2 * inter, hidden), (hidden, inter)]
    return layer, config["num_hidden_layers"], (config["vocab_size"], hidden)


def weights(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """Every GEMM's weight of a forward, in call order."""
    layer, layers, head = shapes()
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in layer * layers + [head]]


def systems(ws: list[torch.Tensor]) -> dict:
    """name -> a pass: every GEMM once, each over `xs[its in_features]`."""
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
    out = {"onednn": lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                 for w, p in zip(ws, onednn)],
           "torch": lambda xs: [F.linear(xs[w.shape[1]], w) for w in ws]}
    if gemm.serves(ws[0]):
        panels = [gemm.pack(w) for w in ws]
        out = {"vattn": lambda xs: [gemm.linear(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, panels)]} | out
    return out


def median_ms(passes: dict, rows: int, repeats: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Median ms of each pass over inputs of `rows` rows, the passes taking turns."""
    widths = {k for _, k in shapes()[0]}
    xs = {k: torch.randn(rows, k).to(dtype) for k in widths}
    samples = {name: [] for name in passes}
    for run in passes.values():
        run(xs)
    for _ in range(repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            run(xs)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def vllm(rows: list[int], repeats: int, gemms: list[tuple[int, int]] | None = None,
         dtype: torch.dtype = torch.float32) -> dict | None:
    """vLLM's pass over `gemms` ((out, in) each; default: a forward's) at each
    row count (`{"vllm", "torch", "ms": {rows: ms}}`), or None without its environment."""
    if peers.vllm_python() is None:
        console.print(f"vllm not measured: {peers.HOW}")
        return None
    layer, layers, head = shapes()
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "ms.json"
        spec.write_text(json.dumps({"gemms": gemms or layer * layers + [head], "rows": rows, "repeats": repeats,
                                    "threads": torch.get_num_threads(),
                                    "dtype": str(dtype).removeprefix("torch.")}))
        proc = peers.popen([str(peers.script("vllm_linears")), str(spec), str(out)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        log = proc.communicate()[0]
        if proc.returncode:
            raise RuntimeError(f"vllm_linears.py failed (exit {proc.returncode}):\n{log[-4000:]}")
        result = json.loads(out.read_text())
    if not result["max_abs_err"] <= TOLERANCE[dtype]:
        raise RuntimeError(f"vLLM's linear is {result['max_abs_err']:.3g} off F.linear (tolerance {TOLERANCE[dtype]})")
    return result


def run(json_path: str | None, rows: list[int] | None = None, repeats: int = 5, dtype: str = "float32") -> dict:
    """`dtype`: the weights' and rows' ("float32" or "bfloat16")."""
    name = dtype
    rows, dtype = list(rows or ROWS), getattr(torch, name)
    ws = weights(dtype)
    flops = {m: 2 * m * sum(w.numel() for w in ws) for m in rows}
    passes = systems(ws)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    console.print(f"linears: {len(ws)} GEMMs a pass ({nbytes / 1e6:.0f} MB of {name} weights), "
                  f"{torch.get_num_threads()} threads, medians of {repeats}")
    ms = {m: median_ms(passes, m, repeats, dtype) for m in rows}
    del passes
    peer = vllm(rows, repeats, dtype=dtype)
    if peer is not None:
        for m in rows:
            ms[m]["vllm"] = peer["ms"][str(m)]
    names = list(ms[rows[0]])
    table = [[m, *(f"{ms[m][n]:.1f} ({flops[m] / ms[m][n] / 1e6:.0f})" for n in names),
              *([f"{ms[m]['vllm'] / ms[m]['vattn']:.2f}×"] if "vattn" in names and "vllm" in names else [])]
             for m in rows]
    columns = ["rows", *(f"{n} ms (GFLOP/s)" for n in names)]
    if "vattn" in names and "vllm" in names:
        columns.append("vattn vs vllm")
    print_table(f"one forward's GEMMs, SmolLM2-135M {name}", columns, table)
    result = {"threads": torch.get_num_threads(), "repeats": repeats, "gemms": len(ws), "dtype": name,
              "weight_bytes": nbytes, "rows": rows,
              "ms": {str(m): ms[m] for m in rows},
              "gflops": {str(m): {n: flops[m] / ms[m][n] / 1e6 for n in ms[m]} for m in rows},
              "versions": {"torch": torch.__version__} | ({"vllm": peer["vllm"]} if peer else {})}
    write_json(json_path, result)
    return result
