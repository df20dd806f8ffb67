"""Runs a step's forward through an unmodified transformers model over a KV cache.

The model's attention is switched to `vattn.attention` (which writes K/V into
the cache and reads live rows only, through its data plane); its linears
are packed and merged for the CPU (`linears`), or the whole model is
compiled (`compile`).  Each step is one flat batch, through the engine's own
forward over the model's modules where it knows the architecture
(`forward`), else through the model called with `use_cache=False`; the
logits of the rows that sample come back.  A step is `prepare`d (the
kernel's per-step state made), then `run`.  `close()` gives the model back as
it came.
"""
import contextlib
import time
from dataclasses import dataclass

import torch

from vattn import attention
from vattn.attention import AttentionStep, registry
from vattn.attention.batch import StepBatch
from vattn.attention.sdpa import backends
from vattn.executor.forward import DecoderForward
from vattn.executor.inputs import StepInputs
from vattn.executor.linears import serve_linears
from vattn.kv.slots import SlotCache


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How the model runs, as asked (`EngineConfig`'s fields of these names);
    what applies follows from `compile` and `sharded` in one place, the
    properties below.  `attention`: the attention kernel by name
    (`registry.KERNELS`; None: the first that serves the cache); `rows`: the
    GEMM rows oneDNN's packed layout is chosen for."""

    attention: str | None = None
    pack_linears: bool = True
    fuse_projections: bool = True
    native_gemm: bool = True
    own_forward: bool = True
    fuse_elementwise: bool = True
    compile: bool = False
    sharded: bool = False  # DTensor weights (tensor parallelism): the linears and the forward stay transformers'
    rows: int = 32

    @property
    def pack(self) -> bool:
        return self.pack_linears and not (self.compile or self.sharded)  # inductor's freezing packs compiled ones

    @property
    def merge(self) -> bool:
        return self.fuse_projections and not (self.compile or self.sharded)

    @property
    def decoder(self) -> bool:
        return self.own_forward and not (self.compile or self.sharded)


@dataclass(slots=True)
class PreparedStep:
    """A step ready to run: its inputs, its attention, and the rows a batched
    kernel call reads whole where nothing backs what is not mapped (None: it
    reads no such range), made readable by `run`."""

    inputs: StepInputs
    attention: AttentionStep
    fill: tuple[int, int, int] | None
    fill_seconds: float = 0.0  # spent making `fill` readable

    @property
    def pins_pages(self) -> bool:
        """Whether no page may be mapped or unmapped while the forward runs
        (it reads a range made readable just before)."""
        return self.fill is not None


class ModelRunner:
    def __init__(self, model, cache: SlotCache, options: RunnerOptions = RunnerOptions()):
        """`compile`: run the model through `torch.compile` instead, one graph
        for every step (its token and row counts are unbacked sizes), with
        inductor's freezing, which packs the weights itself.  The engine's own
        forward runs where it applies (not compiled), with `fuse_elementwise`
        its elementwise work in the C core (`vattn.binding`)."""
        self.kernel = registry.pick_for(cache, options.attention)
        attention.register()
        self.model, self.data, self.options = model.eval(), cache.data, options
        self.linears = serve_linears(model, options.pack, options.merge, options.rows, options.native_gemm)
        self._model_attention = model.config._attn_implementation  # given back by close()
        model.set_attn_implementation(attention.NAME)
        self.per_request_decodes = 0  # layers whose decode took one kernel call per request
        self._forward = torch.compile(model, dynamic=True) if options.compile else model
        self.decoder = (DecoderForward.of(model, cache.config.max_seq_len, options.fuse_elementwise)
                        if options.decoder else None)

    def prepare(self, inputs: StepInputs) -> PreparedStep:
        """The step made ready to run: its attention's per-step state, and
        the range a batched kernel call reads whole, if any."""
        batch = StepBatch(inputs.decode_slots, inputs.decode_positions, inputs.chunks)
        step = attention.prepare(batch, self.data, self.kernel)
        fill = None
        if self.kernel.range_read is not None and not self.data.zero_backed:
            fill = self.kernel.range_read(batch)
        return PreparedStep(inputs, step, fill)

    def run(self, prepared: PreparedStep) -> torch.Tensor:
        """Logits `[rows, vocab]` (on the host), a row per work that samples,
        in plan order; on the host the engine's own forward writes the next
        run's logits over them.  The step's pages must be mapped: a range it
        reads whole is made readable first."""
        if prepared.fill is not None:
            start = time.perf_counter()
            self.data.readable(*prepared.fill, fill=True)
            prepared.fill_seconds = time.perf_counter() - start
        step, device = prepared.inputs, self.model.device
        ids = torch.tensor([step.token_ids], device=device)  # [1, T]: one sequence, to the model
        rows = torch.tensor(step.sample_rows or [len(step.token_ids) - 1], device=device)
        positions = prepared.attention.batch.positions(self.data.device)
        with torch.inference_mode(), backends(self.data.device):
            if self.decoder is not None:
                logits = self.decoder(ids[0], positions[0], rows, prepared.attention)
            else:
                logits = self._model_logits(ids, positions, rows, prepared.attention)
        self.per_request_decodes += getattr(prepared.attention.calls, "per_request_decodes", 0)
        return logits.cpu()  # sampling runs on the host, with each sequence's own generator

    def _model_logits(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                      step: AttentionStep) -> torch.Tensor:
        """The model's own forward (compiled or not) over the step, as one sequence `[1, T]`."""
        inputs = dict(input_ids=ids, position_ids=positions, logits_to_keep=rows)
        if self.options.compile:  # no size is specialized (dynamic shapes otherwise recompile for 1)
            for name, dim in (("input_ids", 1), ("position_ids", 1), ("logits_to_keep", 0)):
                torch._dynamo.decorators.mark_unbacked(inputs[name], dim)
        with attention.running(step), _freezing(self.options.compile):
            return self._forward(**inputs, use_cache=False).logits[0]

    def close(self) -> None:
        """Give the model its own linears and attention back."""
        self._forward = self.decoder = None
        self.linears.restore()
        self.model.set_attn_implementation(self._model_attention)


def _freezing(compiled: bool):
    """Inductor's freezing (weights as constants, pre-packed) for the compile a call may make."""
    if not compiled:
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(freezing=True)
