"""Runs a step plan through an unmodified transformers model.

The model's attention is switched to `vattn.attention` (which writes K/V into
the cache and reads live rows only); its linears are packed and
fused for the CPU (`linears`); the model is called with `use_cache=False`,
one flat batch per step, and the logits of the rows that sample come back.
`close()` gives the model back as it came.
"""
import torch

from vattn import attention
from vattn.attention import registry
from vattn.engine.linears import serve_linears
from vattn.engine.plan import StepPlan
from vattn.kv.slots import SlotCache


class ModelRunner:
    def __init__(self, model, cache: SlotCache, kernel: str | None = None, pack: bool = True, fuse: bool = True,
                 rows: int = 32):
        """`kernel`: the attention kernel by name (`registry.KERNELS`); None:
        the first that serves the cache's device, dtype, kind and head dim.
        `pack`, `fuse`: `serve_linears`'s, for GEMMs of about `rows` rows."""
        c = cache.config
        self.kernel = registry.pick(cache.device.type, c.dtype, cache.kind, c.head_dim, kernel)
        attention.register()
        self.model, self.cache = model.eval(), cache
        self.linears = serve_linears(model, pack, fuse, rows)
        self._model_attention = model.config._attn_implementation  # given back by close()
        model.set_attn_implementation(attention.NAME)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Logits `[rows, vocab]` (on the host), a row per work that samples, in plan order."""
        batch = attention.StepBatch(self.cache, [w.slot for w in plan.decodes], [w.start for w in plan.decodes],
                                    [(w.slot, w.start, w.num_tokens) for w in plan.prefills], self.kernel)
        ids, rows = [], []
        for w in plan.work:
            ids += w.seq.token_ids[w.start:w.start + w.num_tokens]
            if w.samples:
                rows.append(len(ids) - 1)
        device = self.model.device
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=device),
                             position_ids=batch.positions()[None], use_cache=False,
                             logits_to_keep=torch.tensor(rows or [len(ids) - 1], device=device), vattn_batch=batch)
        return out.logits[0].cpu()  # sampling runs on the host, with each sequence's own generator

    def close(self) -> None:
        """Give the model its own linears and attention back."""
        self.linears.restore()
        self.model.set_attn_implementation(self._model_attention)
