"""The served model's linear layers, made faster on the CPU, and given back.

`serve_linears(model, pack, fuse, rows, native_gemm)` replaces the model's
`nn.Linear`s in place; `ServedLinears.restore()` puts every original module
back, its weight bit for bit.

- Pack: a weight is reordered once for the GEMM that runs it, so no GEMM
  reorders it on every call: into the panels of vattn's own GEMM
  (`vattn.executor.gemm`: float32 where the CPU has AVX-512, bfloat16 where
  oneDNN does not pack it) where `native_gemm` is set; else into oneDNN's
  blocked layout (torch's own mkldnn linear, whose pre-packed form
  inductor's freezing path uses).  CPU only.
- Fuse: in architectures known to project one input several times in a row
  (`MERGED`: Q, K and V; gate and up), those linears become one GEMM, and each
  original name holds a module that returns its columns of that GEMM's output.

While served, a weight is held once: the original parameter's storage is let
go and rebuilt from the served weight by `restore()`, unless the model uses
that parameter elsewhere too (a tied LM head), which keeps both.  An
original weight read from a mapped file (safetensors) has its pages
reclaimed once packed, since the file stays mapped for the model's other
weights: a let-go one is not read again, a kept one (the tied embedding)
only in the rows its lookups touch.
"""
import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

import vattn.executor.gemm as gemm
from vattn.backends.host import page_out_file_pages, trim_heap

# model_type -> (the parent module's last name, the linears it calls on one input), in call order
_LLAMA_LIKE = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
MERGED = {"llama": _LLAMA_LIKE, "mistral": _LLAMA_LIKE, "qwen2": _LLAMA_LIKE}
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing(weight: torch.Tensor, native_gemm: bool = True) -> str | None:
    """How `weight` is packed: "native" (vattn's GEMM, where `native_gemm`), "onednn", or None (it is not)."""
    if native_gemm and gemm.serves(weight):
        return "native"
    if weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and torch.backends.mkldnn.is_available() and (
            weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "onednn"  # oneDNN packs bfloat16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
    return None


class Linear(nn.Module):
    """`x W^T + b` over a weight packed (`packing`: "native" for vattn's
    GEMM, "onednn") or kept as given (None)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, rows: int,
                 native_gemm: bool = True):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packing = packing(weight, native_gemm) if pack else None
        if self.packing == "native":
            weight = gemm.pack(weight)
        elif self.packing == "onednn":
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        self._weight, self._bias = weight, bias

    @property
    def packed(self) -> bool:
        return self.packing is not None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: rows `[rows, out_features]` vattn's GEMM writes into (the
        other packings return their own)."""
        if self.packing == "native":
            return gemm.linear(x, self._weight, self.out_features, self._bias, out)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self._weight, self._bias, "none", [], "")
        return F.linear(x, self._weight, self._bias)

    def served(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as served (packed as `packing` says) and the bias."""
        return self._weight, self._bias

    def dense(self) -> torch.Tensor:
        if self.packing == "native":
            return gemm.unpack(self._weight, self.out_features, self.in_features)
        return self._weight.to_dense() if self.packing == "onednn" else self._weight

    @property
    def nbytes(self) -> int:
        return self._weight.numel() * self._weight.element_size()

    def let_go(self) -> None:
        """Free the served weight (the module serves no more)."""
        self._weight = torch.empty(0, dtype=self._weight.dtype, device=self._weight.device)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packing={self.packing}"


class Merged(nn.Module):
    """One GEMM for linears that read the same input; part `i` gets its
    columns.  The output is computed when a part asks with an input it was not
    computed from (another tensor, or the same one changed in place where
    torch counts versions: not in inference mode), or asks twice, and let go
    once every part has read it."""

    def __init__(self, linears: list[nn.Linear], pack: bool, rows: int, native_gemm: bool = True):
        super().__init__()
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
        self.gemm = Linear(torch.cat([m.weight for m in linears]), bias, pack, rows, native_gemm)
        ends = list(itertools.accumulate(m.out_features for m in linears))
        self.columns = [slice(end - m.out_features, end) for end, m in zip(ends, linears)]
        self._input, self._version, self._output, self._unread = None, -1, None, set()

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        version = -1 if x.is_inference() else x._version
        if x is not self._input or version != self._version or i not in self._unread:
            self._input, self._version, self._output = x, version, self.gemm(x)
            self._unread = set(range(len(self.columns)))
        self._unread.discard(i)
        out = self._output[..., self.columns[i]]
        if not self._unread:
            self._input = self._output = None
        return out


class Part(nn.Module):
    """Linear `index` of a `Merged` group, under the original linear's name."""

    def __init__(self, group: Merged, index: int):
        super().__init__()
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)


@dataclass
class ServedLinears:
    """What `serve_linears` changed, to undo it."""

    replaced: list[tuple[nn.Module, str, nn.Linear]] = field(default_factory=list)  # (parent, name, original)
    released: list[tuple[nn.Parameter, Linear, slice]] = field(default_factory=list)  # (weight, served, its rows)
    served: list[Linear] = field(default_factory=list)
    held_twice: int = 0  # bytes of weights the model also uses elsewhere, so kept in both forms
    paged_out: int = 0  # bytes of original weights whose pages of a mapped file were reclaimed

    @property
    def num_packed(self) -> int:
        return sum(m.packed for m in self.served)

    @property
    def num_gemms(self) -> int:
        return len(self.served)

    @property
    def nbytes(self) -> int:
        """Bytes of the served weights."""
        return sum(m.nbytes for m in self.served)

    def restore(self) -> None:
        """Every original linear back in its place, with its own weight: each
        served weight is unpacked once for its originals, then let go."""
        originals = defaultdict(list)  # served -> (weight, its rows)
        for weight, served, part in self.released:
            originals[served].append((weight, part))
        for served, weights in originals.items():
            dense = served.dense()
            for weight, part in weights:
                weight.data = dense[part].clone()
            served.let_go()
        if originals:
            trim_heap()
        for parent, name, original in self.replaced:
            setattr(parent, name, original)
        self.replaced, self.released, self.served, self.held_twice, self.paged_out = [], [], [], 0, 0


def serve_linears(model: nn.Module, pack: bool = True, fuse: bool = True, rows: int = 32,
                  native_gemm: bool = True) -> ServedLinears:
    """Pack (`pack`; with `native_gemm`, for vattn's GEMM where it serves) and fuse
    (`fuse`) the model's linears in place; `rows`: the GEMM rows oneDNN's
    layout is chosen for.  Nothing is changed when neither applies; a failure
    part way leaves the model as it was."""
    done = ServedLinears()
    if not (pack or fuse):
        return done
    groups = _fusable(model) if fuse else []
    grouped = {id(m) for _, _, linears in groups for m in linears}
    singles = [(parent, name, m) for parent, name, m in _linears(model)
               if pack and id(m) not in grouped and packing(m.weight, native_gemm)]
    owners = defaultdict(set)  # parameter -> the modules that hold it
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners[id(p)].add(id(module))
    try:
        for parent, names, linears in groups:
            group = Merged(linears, pack, rows, native_gemm)
            done.served.append(group.gemm)
            for i, name in enumerate(names):
                _replace(done, owners, parent, name, Part(group, i), group.gemm, group.columns[i])
        for parent, name, m in singles:
            served = Linear(m.weight, m.bias, pack, rows, native_gemm)
            done.served.append(served)
            _replace(done, owners, parent, name, served, served, slice(None))
    except BaseException:
        done.restore()
        raise
    if done.released:
        trim_heap()
    return done


def projections(parent: nn.Module, names: tuple[str, ...]):
    """x -> the outputs of `parent`'s linears `names` on x, side by side
    (`[..., sum of their out_features]`): one GEMM where `serve_linears`
    fused them in that order, else each linear and their concatenation."""
    modules = [getattr(parent, n) for n in names]
    group = getattr(modules[0], "group", None)
    if isinstance(group, Merged) and len(group.columns) == len(modules) and all(
            isinstance(m, Part) and m.group is group and m.index == i for i, m in enumerate(modules)):
        return group.gemm
    return lambda x: torch.cat([m(x) for m in modules], -1)


def _replace(done: ServedLinears, owners, parent: nn.Module, name: str, module: nn.Module, served: Linear,
             part: slice) -> None:
    """`parent.name` becomes `module`, computed by `served`, whose weight rows `part` are the original's."""
    original = getattr(parent, name)
    setattr(parent, name, module)
    done.replaced.append((parent, name, original))
    done.paged_out += page_out_file_pages([original.weight])  # packing read every page; few are read again
    if owners[id(original.weight)] == {id(original)}:  # the served weight is a copy: let the original go
        done.released.append((original.weight, served, part))
        original.weight.data = torch.empty(0, dtype=original.weight.dtype, device=original.weight.device)
    else:
        done.held_twice += original.weight.numel() * original.weight.element_size()


def _linears(model: nn.Module):
    for parent in model.modules():
        for name, m in parent.named_children():
            if type(m) is nn.Linear:
                yield parent, name, m


def _fusable(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...], list[nn.Linear]]]:
    """(parent, names, linears) of each group `MERGED` names for the model's architecture whose
    linears match: plain `nn.Linear`s on one input size, device and dtype, all with biases or none."""
    spec = MERGED.get(getattr(getattr(model, "config", None), "model_type", None), ())
    groups = []
    for parent_name, parent in model.named_modules():
        for last, names in spec:
            if parent_name.rsplit(".", 1)[-1] != last:
                continue
            linears = [getattr(parent, n, None) for n in names]
            if all(type(m) is nn.Linear for m in linears) and len({
                    (m.in_features, m.weight.device, m.weight.dtype, m.bias is None) for m in linears}) == 1:
                groups.append((parent, names, linears))
    return groups
