"""The model shapes the benchmarks use, written once.

SmolLM2-135M is the model the benchmarks run; Llama-3-8B (and one GPU's share
of Llama-3-70B under 8-way tensor parallelism) give the KV geometries of the
models vAttention and vLLM are measured on.
"""
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int

    def cache_fields(self) -> dict:
        """The `CacheConfig` fields this shape sets."""
        return dict(num_layers=self.layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim)


SMOLLM2_135M = Shape(layers=30, heads=9, kv_heads=3, head_dim=64)
LLAMA_3_8B = Shape(layers=32, heads=32, kv_heads=8, head_dim=128)
LLAMA_3_70B_TP8 = Shape(layers=80, heads=8, kv_heads=1, head_dim=128)  # one GPU's share: 64 and 8 heads over 8 GPUs

# SmolLM2-135M-Instruct's whole architecture (a transformers `LlamaConfig`), for a run without its weights
SMOLLM2_135M_CONFIG = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=SMOLLM2_135M.layers,
    num_attention_heads=SMOLLM2_135M.heads, num_key_value_heads=SMOLLM2_135M.kv_heads, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
