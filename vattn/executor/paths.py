"""Which code each kernel of the engine's forward runs on this CPU, dtype by
dtype: what `vattn info` names and the tests report."""
import torch

import vattn.binding as binding
from vattn import dtypes
from vattn.executor import gemm


def kernel_paths() -> list[tuple[str, str]]:
    """(kernel, the code it runs here) pairs."""
    isa, bf16 = binding.isa(), dtypes.cpu_bf16()
    lanes = f"{isa}, {16 if isa == 'avx512' else 8} float32 lanes"
    own = {name: gemm.serves(torch.ones(1, 1, dtype=getattr(torch, name))) for name in ("float32", "bfloat16")}
    onednn = {"float32": "oneDNN, pre-packed",
              "bfloat16": f"oneDNN, pre-packed, on {', '.join(bf16) or 'AVX-512 without bfloat16 instructions'}"}
    auto, why = dtypes.choose("auto", torch.bfloat16)
    return [
        ("attention (native)", f"{lanes}; bfloat16 K/V widened to float32 as read"),
        ("elementwise (RMSNorm, SiLU·up, rotary)", f"{isa}; float32 and bfloat16 rows, float32 sums"),
        *((f"GEMM, {name}", f"vattn's, {lanes}" if own[name] else onednn[name]) for name in own),
        ("decoder layers in one call", ", ".join(name for name in own if own[name]) or "off: it needs vattn's GEMM"),
        ("bfloat16 instructions", ", ".join(bf16) or "none"),
        ("dtype auto, a bfloat16 checkpoint", f"{str(auto).removeprefix('torch.')}: {why}"),
    ]
