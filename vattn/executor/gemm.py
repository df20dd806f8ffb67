"""The engine's own GEMM on the host (`native/linear.c`, through
`vattn.binding`): `x W^T + b` in float32 or bfloat16 over a weight packed
once into panels of `PANEL` output columns, zeros past the last column:
float32 `[panels, in_features, PANEL]`; bfloat16 `[panels, in_features / 2,
PANEL, 2]`, each column's inputs in pairs as AVX512-BF16's `vdpbf16ps` reads
them (an odd last input paired with zero), viewed `[panels, 2 · pairs, PANEL]`.

It runs float32 weights where the CPU has AVX-512: at the few rows of a
decode step it streams them faster than oneDNN's packed inner product and
vLLM's CPU linear, and at a prefill chunk's hundreds of rows it keeps pace
with them (`vattn bench linears`); elsewhere oneDNN does better.  It runs
bfloat16 weights on `vdpbf16ps` where the CPU has AVX512-BF16 and no AMX
(AMX's tiles are oneDNN's at a prefill's many rows), and where oneDNN does
not pack them (no AVX-512): torch's own bfloat16 linear there is 3-5 times
slower than it (`vattn bench linears`).
"""
import torch
import torch.nn.functional as F

import vattn.binding as binding
from vattn.backends.host import HugePages

PANEL = binding.LINEAR_PANEL
_PAGES = HugePages()  # the packed weights: streamed from memory at a decode step's few rows


def serves(weight: torch.Tensor) -> bool:
    """Whether `weight` is this GEMM's to run (see above)."""
    if not (weight.is_cpu and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16)):
        return False
    bf16 = weight.dtype == torch.bfloat16
    return binding.linear_serves(bf16) or (bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` as panels (see above), in huge pages (`HugePages`)."""
    n, k = weight.shape
    whole, tail, bf16 = n // PANEL, n % PANEL, weight.dtype == torch.bfloat16
    depth = k + k % 2 if bf16 else k
    panels = _PAGES.empty(-(-n // PANEL), depth, PANEL, dtype=weight.dtype)
    if tail:
        panels[whole].zero_()
    if not bf16:
        panels[:whole] = weight[:whole * PANEL].view(whole, PANEL, k).transpose(1, 2)
        panels[whole:, :, :tail] = weight[whole * PANEL:].t()
        return panels
    padded = weight if depth == k else F.pad(weight, (0, 1))
    pairs = panels.view(-1, depth // 2, PANEL, 2)  # [panel, pair, column, 2]
    pairs[:whole] = padded[:whole * PANEL].view(whole, PANEL, depth // 2, 2).transpose(1, 2)
    pairs[whole:, :, :tail] = padded[whole * PANEL:].view(tail, depth // 2, 2).transpose(0, 1)
    return panels


def unpack(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The `[out_features, in_features]` weight `pack` made `panels` of, bit for bit."""
    count, depth = panels.shape[:2]
    if panels.dtype == torch.bfloat16:
        columns = panels.view(count, depth // 2, PANEL, 2).permute(0, 2, 1, 3)
    else:
        columns = panels.transpose(1, 2)
    return columns.reshape(count * PANEL, depth)[:out_features, :in_features].clone()


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., in] W^T + bias` of the weight packed in `panels`, written into
    `out [rows, out_features]` where given."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = rows.new_empty(rows.shape[0], out_features)
    binding.linear(out, rows, panels, bias)
    return out.view(*x.shape[:-1], out_features)

