"""The engine's own GEMM on the host (`native/linear.c`, through
`vattn.binding`): `x W^T + b` in float32 or bfloat16 over a weight packed
once into panels of `PANEL` output columns (`[panels, in_features, PANEL]`,
zeros past the last column).

It runs float32 weights where the CPU has AVX-512: at the few rows of a
decode step it streams them faster than oneDNN's packed inner product and
vLLM's CPU linear, and at a prefill chunk's hundreds of rows it keeps pace
with them (`vattn bench linears`); elsewhere oneDNN does better.  It runs
bfloat16 weights where oneDNN does not pack them (no AVX-512): torch's own
bfloat16 linear there is 3-5 times slower than it (`vattn bench linears`).
"""
import torch

import vattn.binding as binding
from vattn.backends.host import HugePages

PANEL = binding.LINEAR_PANEL
_PAGES = HugePages()  # the packed weights: streamed from memory at a decode step's few rows


def serves(weight: torch.Tensor) -> bool:
    """Whether `weight` is this GEMM's to run (see above)."""
    if not (weight.is_cpu and weight.dim() == 2):
        return False
    if weight.dtype == torch.float32:
        return binding.linear_serves()
    return weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` as panels `[ceil(out / PANEL), in, PANEL]`, in huge pages (`HugePages`)."""
    n, k = weight.shape
    whole = n // PANEL
    panels = _PAGES.empty(-(-n // PANEL), k, PANEL, dtype=weight.dtype)
    panels[:whole] = weight[:whole * PANEL].view(whole, PANEL, k).transpose(1, 2)
    if n % PANEL:
        panels[whole].zero_()
        panels[whole, :, :n % PANEL] = weight[whole * PANEL:].t()
    return panels


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The `[out_features, in]` weight `pack` made `panels` of, bit for bit."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features].clone()


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

