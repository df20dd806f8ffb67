"""Runs a step plan through an unmodified transformers model.

The model's attention is switched to `vattn.attention` (which writes K/V into
the cache and reads live rows only); its linears are packed and
fused for the CPU (`linears`), or the whole model is compiled (`compile`).
Each step is one flat batch, through the engine's own forward over the
model's modules where it knows the architecture (`forward`), else through
the model called with `use_cache=False`; the logits of the rows that sample
come back.
`close()` gives the model back as it came.
"""
import contextlib

import torch

from vattn import attention
from vattn.attention import registry, sdpa
from vattn.engine.forward import DecoderForward
from vattn.engine.linears import serve_linears
from vattn.engine.plan import StepInputs
from vattn.kv.slots import SlotCache


class ModelRunner:
    def __init__(self, model, cache: SlotCache, kernel: str | None = None, pack: bool = True, fuse: bool = True,
                 rows: int = 32, compile: bool = False, own_forward: bool = True, fuse_elementwise: bool = True,
                 native_gemm: bool = True):
        """`kernel`: the attention kernel by name (`registry.KERNELS`); None:
        the first that serves the cache's device, dtype, kind and head dim.
        `pack`, `fuse`, `native_gemm`: `serve_linears`'s (pack, fuse,
        native), for GEMMs of about `rows` rows.
        `compile`: run the model through `torch.compile` instead, one graph
        for every step (its token and row counts are unbacked sizes), with
        inductor's freezing, which packs the weights itself.  `own_forward`:
        the engine's own forward where it applies (not compiled), with
        `fuse_elementwise` its elementwise work fused (`vattn.engine.fused`)."""
        self.kernel = registry.pick_for(cache, kernel)
        attention.register()
        self.model, self.cache = model.eval(), cache
        self.linears = serve_linears(model, pack and not compile, fuse and not compile, rows, native_gemm)
        self._model_attention = model.config._attn_implementation  # given back by close()
        model.set_attn_implementation(attention.NAME)
        self.compiled = compile
        self.per_request_decodes = 0  # layers whose decode took one kernel call per request (`StepBatch`)
        self._forward = torch.compile(model, dynamic=True) if compile else model
        self.decoder = (DecoderForward.of(model, cache.config.max_seq_len, fuse_elementwise)
                        if own_forward and not compile else None)

    def batch(self, inputs: StepInputs) -> attention.StepBatch:
        """What the forward holds, for its kernels."""
        return attention.StepBatch(self.cache, inputs.decode_slots, inputs.decode_positions, inputs.chunks,
                                   self.kernel)

    def zero_fill_range(self, batch: attention.StepBatch) -> tuple[int, int, int] | None:
        """(lo, hi, length): the rows the kernel reads whole in this step where
        nothing backs what is not mapped (a virtual cache on CUDA), for
        `VirtualKVCache.zero_fill` once the step's pages are mapped; else None."""
        if self.kernel.range_read is None or self.cache.kind != "virtual" or self.cache.storage.zero_backed:
            return None
        return self.kernel.range_read(batch)

    def run(self, step: StepInputs, batch: attention.StepBatch) -> torch.Tensor:
        """Logits `[rows, vocab]` (on the host), a row per work that samples,
        in plan order; on the host the engine's own forward writes the next
        run's logits over them."""
        device = self.model.device
        ids = torch.tensor([step.token_ids], device=device)  # [1, T]: one sequence, to the model
        rows = torch.tensor(step.sample_rows or [len(step.token_ids) - 1], device=device)
        with torch.inference_mode(), sdpa.backends(self.cache.device):
            if self.decoder is not None:
                logits = self.decoder(ids[0], batch.positions()[0], rows, batch)
            else:
                logits = self._model_logits(ids, rows, batch)
        self.per_request_decodes += batch.per_request_decodes
        return logits.cpu()  # sampling runs on the host, with each sequence's own generator

    def _model_logits(self, ids: torch.Tensor, rows: torch.Tensor, batch: attention.StepBatch) -> torch.Tensor:
        """The model's own forward (compiled or not) over the step, as one sequence."""
        inputs = dict(input_ids=ids, position_ids=batch.positions(), logits_to_keep=rows)
        if self.compiled:  # no size is specialized (dynamic shapes otherwise recompile for 1)
            for name, dim in (("input_ids", 1), ("position_ids", 1), ("logits_to_keep", 0)):
                torch._dynamo.decorators.mark_unbacked(inputs[name], dim)
        with attention.step(batch), _freezing(self.compiled):
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
