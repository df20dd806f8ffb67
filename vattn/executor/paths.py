"""Which code each kernel of the engine's forward runs on this CPU, dtype by
dtype: what `vattn info` names and the tests report."""
import torch

import vattn.binding as binding
from vattn import dtypes
from vattn.executor import gemm


def kernel_paths() -> list[tuple[str, str]]:
    """(kernel, the code it runs here) pairs."""
    isa, bf16 = binding.isa(), dtypes.cpu_bf16()
    # the code the kernels other than attention run under amx and avx512_bf16
    vector_isa = "avx512" if isa in ("amx", "avx512_bf16") else isa
    lanes = f"{vector_isa}, {16 if vector_isa == 'avx512' else 8} float32 lanes"
    attention_bf16 = {
        "amx": "decode: QK on AMX tiles, PV on vdpbf16ps; prefill chunks: QK and PV on AMX tiles (a head dim "
               "that is a multiple of 32; else as avx512_bf16)",
        "avx512_bf16": "QK and PV on vdpbf16ps, K and V read as stored",
    }.get(isa, "bfloat16 K/V widened to float32 as read")
    own = {name: gemm.serves(torch.ones(1, 1, dtype=getattr(torch, name))) for name in ("float32", "bfloat16")}
    onednn = {"float32": "oneDNN, pre-packed",
              "bfloat16": f"oneDNN, pre-packed, on {', '.join(bf16) or 'AVX-512 without bfloat16 instructions'}"}
    gemm_code = {"float32": lanes, "bfloat16": "vdpbf16ps on pairs of bfloat16 inputs" if isa in ("amx", "avx512_bf16")
                 else f"{lanes}, bfloat16 weights widened as loaded"}
    auto, why = dtypes.choose("auto", torch.bfloat16)
    return [
        ("attention (native)", f"{isa}, {16 if vector_isa == 'avx512' else 8} float32 lanes; {attention_bf16}"),
        ("elementwise (RMSNorm, SiLU·up, rotary)", f"{vector_isa}; float32 and bfloat16 rows, float32 sums"),
        *((f"GEMM, {name}", f"vattn's, {gemm_code[name]}" if own[name] else onednn[name]) for name in own),
        ("decoder layers in one call", ", ".join(name for name in own if own[name]) or "off: it needs vattn's GEMM"),
        ("bfloat16 instructions", ", ".join(bf16) or "none"),
        ("dtype auto, a bfloat16 checkpoint", f"{str(auto).removeprefix('torch.')}: {why}"),
    ]
