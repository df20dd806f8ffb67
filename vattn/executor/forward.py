"""The engine's own forward for the decoder architectures it knows
(`ARCHITECTURES`: Llama, Mistral, Qwen2), over the model's own modules and
weights.

It does transformers' arithmetic in transformers' order, so its logits are
theirs bit for bit.  What it leaves out is the per-call machinery around that
arithmetic: keyword plumbing and decorators, masks the engine's kernels do
not read, per-layer dispatch through the attention interface and its torch
operator.  The step is one flat batch of `[T, hidden]` rows; the rotary
embedding's cos and sin are rows of a table made once (where they depend on
the position alone); Q and K are rotated together; the final norm and the LM
head run on the rows that sample only (in the elementwise forward, the last
layer's o_proj and MLP too: the other rows' K/V are all the cache needs of
them).

With `elementwise` (float32 or bfloat16 rows on the host) the work between
the GEMMs runs as one call into the C core each (`vattn.binding`): RMSNorm
with the residual add before it, SiLU(gate)·up, the rotary embedding in
place, summing in float32 and rounding bfloat16 where transformers does.
The logits then equal transformers' within float32 rounding (the norm's sum
and SiLU's exp are vattn's own), not bit for bit.  That forward writes its GEMMs' and
kernels' rows into buffers it keeps (`_Buffers`), so a step allocates almost
nothing; its logits are overwritten by the next call.  Where vattn's GEMM
runs every linear and its kernel the attention (on the host: float32 where
the CPU has AVX-512, bfloat16 where oneDNN does not pack it), all the layers
are one call (`native/decoder.c`): the same kernels in the same order, with
no Python between them.

`DecoderForward.of(model)` is None for a model it cannot run as transformers
would (another architecture, a layer of another kind, hooks on a module):
the engine then calls the model itself.
"""
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import vattn.binding as binding
from vattn.attention import AttentionStep, attend
from vattn.executor.linears import Linear, projections

ARCHITECTURES = {  # model_type -> the class name prefix of its modules
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
}


@dataclass(slots=True, frozen=True)
class _Layer:
    index: int
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: Callable[[torch.Tensor], torch.Tensor]  # x -> [q | k | v]
    o_proj: nn.Module
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # x -> [gate | up]
    act: nn.Module
    down_proj: nn.Module
    scaling: float
    window: int
    norms: tuple[nn.Module, nn.Module]  # input, post: their weights for the elementwise kernels


class DecoderForward:
    """`forward(ids, positions, rows, step)`: the logits of `rows`."""

    def __init__(self, model: nn.Module, max_positions: int, fuse_elementwise: bool = False):
        inner, config = model.model, model.config
        self.model, self.inner = model, inner
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.intermediate = config.intermediate_size
        rows = inner.embed_tokens.weight.dtype  # the hidden rows' dtype
        self.final_norm = _rms_norm(inner.norm, rows)
        self.layers = [_Layer(i, _rms_norm(layer.input_layernorm, rows),
                              projections(layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                              layer.self_attn.o_proj, _rms_norm(layer.post_attention_layernorm, rows),
                              projections(layer.mlp, ("gate_proj", "up_proj")), layer.mlp.act_fn,
                              layer.mlp.down_proj, layer.self_attn.scaling, _window(config, layer.self_attn),
                              (layer.input_layernorm, layer.post_attention_layernorm))
                       for i, layer in enumerate(inner.layers[:config.num_hidden_layers])]
        norms = [inner.norm, *(norm for layer in self.layers for norm in layer.norms)]
        weights = [inner.embed_tokens.weight, *(n.weight for n in norms)]  # the kernels take one dtype a call
        self.elementwise = (fuse_elementwise and self.head_dim % 2 == 0
                            and self.head_dim <= binding.ROTATE_MAX_HEAD_DIM
                            and all(binding.serves_rows(w) and w.dtype == rows for w in weights))
        self._buffers = _Buffers()
        self._one_call = None  # (data plane, *`_layer_arguments` for it)
        rope_type = inner.rotary_emb.rope_type
        self._rotary = None  # `_cos_sin` of every position below max_positions, or None: made each step
        if isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope":
            embed = inner.embed_tokens.weight
            with torch.inference_mode():
                self._rotary = self._cos_sin(embed[:1], torch.arange(max_positions, device=embed.device))

    @classmethod
    def of(cls, model: nn.Module, max_positions: int, fuse_elementwise: bool = False) -> "DecoderForward | None":
        """The forward for `model` over positions below `max_positions`, or
        None where it would not be transformers' own; `fuse_elementwise`: the
        elementwise kernels where they serve the model's dtype and device."""
        prefix = ARCHITECTURES.get(getattr(model.config, "model_type", None))
        inner = getattr(model, "model", None)
        if prefix is None or type(model).__name__ != f"{prefix}ForCausalLM" or inner is None:
            return None
        names = {"model": f"{prefix}Model", "rotary": f"{prefix}RotaryEmbedding", "layer": f"{prefix}DecoderLayer",
                 "attention": f"{prefix}Attention", "mlp": f"{prefix}MLP", "norm": f"{prefix}RMSNorm"}
        if (type(inner).__name__ != names["model"] or type(inner.rotary_emb).__name__ != names["rotary"]
                or type(inner.norm).__name__ != names["norm"] or type(inner.embed_tokens) is not nn.Embedding):
            return None
        for layer in inner.layers:
            if (type(layer).__name__ != names["layer"] or type(layer.self_attn).__name__ != names["attention"]
                    or type(layer.mlp).__name__ != names["mlp"] or type(layer.mlp.act_fn).__name__ != "SiLUActivation"
                    or {type(layer.input_layernorm).__name__, type(layer.post_attention_layernorm).__name__}
                    != {names["norm"]}):
                return None
        if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()) or _global_hooks():
            return None
        return cls(model, max_positions, fuse_elementwise)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 step: AttentionStep) -> torch.Tensor:
        """`ids`, `positions [T]`; `rows`: the rows whose logits come back."""
        T = ids.shape[0]
        h = self.inner.embed_tokens(ids)
        cos, sin = self._cos_sin(h, positions) if self._rotary is None else (t[positions] for t in self._rotary)
        if self.elementwise:
            return self._elementwise_forward(h, cos, sin, rows, step)
        cos, sin = cos[:, None], sin[:, None]  # against [T, heads, D]
        H, G, D = self.heads, self.kv_heads, self.head_dim
        for layer in self.layers:
            qkv = layer.qkv(layer.input_norm(h)).view(T, H + 2 * G, D)
            qk = _rotate(qkv[:, :H + G], cos, sin)
            out = attend(step, layer.index, qk[:, :H], qk[:, H:], qkv[:, H + G:], layer.scaling, layer.window)
            h = h + layer.o_proj(out.reshape(T, -1))
            gate_up = layer.gate_up(layer.post_norm(h))
            gate, up = gate_up.tensor_split(2, -1)
            h = h + layer.down_proj(layer.act(gate) * up)
        return self.model.lm_head(self.final_norm(h[rows]))

    def _elementwise_forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                             step: AttentionStep) -> torch.Tensor:
        """`__call__` with the elementwise kernels: every layer in one call into
        the C core where it runs them (`_one_call_layers`), else a loop of
        single calls."""
        T, H, G, D, hidden = h.shape[0], self.heads, self.kv_heads, self.head_dim, h.shape[1]
        take = partial(self._buffers.take, like=h)
        # every layer writes the same rows: each site's taken once a step
        width = {"qkv": (H + 2 * G) * D, "attention": H * D, "o": hidden, "gate_up": 2 * self.intermediate,
                 "act": self.intermediate, "down": hidden}
        out = {site: take(site, rows=T, cols=cols) for site, cols in width.items()}
        layers = self._one_call_layers(step, rows)
        if layers is None:
            h = self._layer_loop(h, cos, sin, rows, step, take, *out.values())
        else:
            writes = step.writes()  # before the kernels store any K/V
            rows_of = {"residual": h, "x": take("x", rows=T, cols=hidden), **out, "cos": cos, "sin": sin}
            binding.decoder_layers(layers, rows_of, step.calls.table, rows, H)
            for write in writes:  # the kernel stored every layer's K/V
                step.data.record(write, range(len(self.layers)))
            h = h[:rows.shape[0]]  # the sampled rows' residual stream, gathered there
        head = self.model.lm_head
        return _gemm(head, _norm_in_place(h, self.inner.norm), take("logits", rows=h.shape[0], cols=head.out_features))

    def _layer_loop(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                    step: AttentionStep, take: Callable, qkv: torch.Tensor, out: torch.Tensor,
                    o: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The layers, a call at a time, into the step's buffers: `h` is the
        residual stream, `x` each sublayer's input (the norm of h) and then
        its output.  Returns the sampled rows' residual stream."""
        T, H, G, D, hidden = h.shape[0], self.heads, self.kv_heads, self.head_dim, h.shape[1]
        heads = out.view(T, H, D)
        x = _norm_in_place(h.clone(), self.layers[0].norms[0])
        for layer, after in zip(self.layers, self.layers[1:] + [None]):
            y = _gemm(layer.qkv, x, qkv)
            binding.rotate(y[:, :(H + G) * D], H + G, cos, sin)
            q, k, v = y.view(T, H + 2 * G, D).split((H, G, G), 1)
            attend(step, layer.index, q, k, v, layer.scaling, layer.window, heads)
            if after is None:  # past the last layer's K/V only the rows that sample are read
                T = rows.shape[0]
                out = torch.index_select(out, 0, rows, out=take("sampling", rows=T, cols=H * D))
                h = torch.index_select(h, 0, rows, out=take("residual", rows=T, cols=hidden))
                o, gate_up, act, down = o[:T], gate_up[:T], act[:T], down[:T]
            x = _norm_in_place(_gemm(layer.o_proj, out, o), layer.norms[1], h)
            x = _gemm(layer.down_proj, binding.silu_mul(_gemm(layer.gate_up, x, gate_up), act), down)
            if after is None:
                h += x
            else:
                _norm_in_place(x, after.norms[0], h)
        return h

    def _one_call_layers(self, step: AttentionStep, rows: torch.Tensor) -> tuple | None:
        """`decoder_layers`' layers over the step's cache, made once a cache,
        or None where that call does not run this forward: a GEMM not vattn's,
        another attention kernel, sampled rows that do not rise."""
        if self._one_call is None or self._one_call[0] is not step.data:
            self._one_call = (step.data, *self._layer_arguments(step))
        layers = self._one_call[1]
        if layers is None or rows.dtype != torch.long or (rows[1:] <= rows[:-1]).any():
            return None
        return layers

    def _layer_arguments(self, step: AttentionStep) -> tuple[tuple | None, list[torch.Tensor]]:
        """The layers' arguments (None where the call cannot run them), and
        the tensors at their addresses, kept alive with them."""
        if step.kernel.name != "native" or step.data.config.dtype != self.inner.embed_tokens.weight.dtype:
            return None, []
        linears = [m for layer in self.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)]
        if not all(isinstance(m, Linear) and m.packing == "native" for m in linears):
            return None, []
        out = [binding.decoder_layer([m.served() for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)],
                                     [(norm.weight, norm.variance_epsilon) for norm in layer.norms],
                                     *step.data.views(layer.index), layer.scaling, layer.window)
               for layer in self.layers]
        keep = [t for m in linears for t in m.served() if t is not None]
        return tuple(out), keep

    def _cos_sin(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary cos and sin `[T, D]` at `positions`, sin's first half negated (`_rotate`)."""
        cos, sin = (t[0] for t in self.inner.rotary_emb(h, positions[None]))
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), -1)


class _Buffers:
    """The elementwise forward's output rows: a buffer for each call site, which
    every layer and step reuses (each layer reads a site's rows before the
    next writes them).  On the host a fresh tensor each call costs more than a
    decode step's small operators: malloc's search, and new pages faulted in."""

    def __init__(self):
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, site: str, like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """`[rows, cols]` of `like`'s dtype and device, from site's buffer (grown where too small)."""
        flat = self._flat.get(site)
        if flat is None or flat.numel() < rows * cols:
            flat = self._flat[site] = like.new_empty(max(rows * cols, 2 * flat.numel() if flat is not None else 0))
        return flat[:rows * cols].view(rows, cols)


def _gemm(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """linear(x), written into `out` where vattn's GEMM runs it (`Linear` packed "native"); a
    `Linear` is called past `nn.Module`'s hook machinery (the forward runs no hooks)."""
    return linear.forward(x, out) if isinstance(linear, Linear) else linear(x)


def _rms_norm(norm: nn.Module, rows: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' RMSNorm `norm` over rows of dtype `rows`; in float32 one
    fused operator, equal to it bit for bit."""
    if norm.weight.dtype == rows == torch.float32:
        return partial(F.rms_norm, normalized_shape=norm.weight.shape, weight=norm.weight, eps=norm.variance_epsilon)
    return norm


def _norm_in_place(x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' RMSNorm `norm` of x (of `residual + x`, kept in `residual`), in place by the C core's kernel."""
    return binding.rms_norm(x, norm.weight, norm.variance_epsilon, residual)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers applies it, `x·cos + rotate_half(x)·sin`,
    with rotate_half's negation moved onto sin (the same products, bit for
    bit): `x·cos + [x2, x1]·[-sin1, sin2]`."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * signed_sin


def _window(config, attn: nn.Module) -> int:
    """The sliding window transformers passes this layer's attention (0: none)."""
    if hasattr(attn, "sliding_window"):  # Qwen2: per layer
        return attn.sliding_window or 0
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None) or 0
    return 0


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)
