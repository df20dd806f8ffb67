"""vLLM's CPU linear, timed for `vattn bench linears`.  Runs under the peer
environment's interpreter (see `peers.py`) and imports nothing of vattn.

    python vllm_linears.py SPEC.json OUT.json

SPEC.json: `gemms` ((out, in) of every GEMM of a pass, in call order),
`rows`, `repeats`, `threads`, `dtype`.  Each weight is seeded random, in `dtype`, given to
`create_onednn_mm` as vLLM's CPU backend does (`dispatch_cpu_unquantized_gemm`:
the transposed weight, a primitive cache of 32); a pass calls `onednn_mm` on
each in turn.  Medians of `repeats` passes after a warm-up pass, as
`linears.median_ms` times them.  The first GEMM's output at the first row
count is compared with `F.linear` in float64 (`max_abs_err`; the harness
judges it).

OUT.json: `vllm` and `torch` versions, `threads`, `ms` by rows, `max_abs_err`.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import vllm
from vllm import _custom_ops as ops


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    weights = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in spec["gemms"]]
    handlers = [(w.shape[1], ops.create_onednn_mm(w.t(), 32)) for w in weights]
    x = torch.randn(spec["rows"][0], weights[0].shape[1], generator=g).to(dtype)
    error = (ops.onednn_mm(handlers[0][1], x, None).double() - x.double() @ weights[0].double().t()).abs().max().item()
    del weights, x  # what vLLM keeps is the handlers' packed weights
    ms = {}
    for rows in spec["rows"]:
        xs = {k: torch.randn(rows, k).to(dtype) for k in {k for k, _ in handlers}}

        def run():
            for k, handler in handlers:
                ops.onednn_mm(handler, xs[k], None)

        run()
        samples = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            run()
            samples.append((time.perf_counter() - start) * 1e3)
        ms[str(rows)] = statistics.median(samples)
    Path(out_path).write_text(json.dumps({"vllm": vllm.__version__, "torch": torch.__version__,
                                          "threads": torch.get_num_threads(), "ms": ms, "max_abs_err": error}))


if __name__ == "__main__":
    main(*sys.argv[1:])
