"""Engine settings (vLLM's names where they exist)."""
import dataclasses
from dataclasses import dataclass

import torch

from vattn import dtypes
from vattn.checks import is_int, is_number
from vattn.config import CacheConfig, check_utilization
from vattn.executor.runner import RunnerOptions
from vattn.kv.shared import PoolMember

DEFAULT_MAX_SEQ_LEN = 2048  # or the model's positions, if fewer

PREEMPTION_MODES = ("recompute", "swap")
KV_CACHES = ("virtual", "paged")


@dataclass(slots=True)
class EngineConfig:
    """`max_num_seqs` sequences run at once, one cache slot each;
    `max_num_batched_tokens` bounds the tokens of one forward (decode tokens
    first, then prefill chunks).  A waiting request is admitted only while the
    tokens of the running sequences (prompts and answers so far) and of its
    prompt stay within `max_running_tokens` (None: no limit), or nothing runs:
    past that a decode step's time grows with the tokens its attention reads,
    so more sequences add memory and time a token, not tokens a second.
    `max_seq_len` (vLLM's `max_model_len`) defaults to 2048 or the model's
    positions (`max_position_embeddings`), if fewer; a larger one is refused
    unless `allow_long_max_seq_len` says the model is good past its positions.
    `memory_budget` is the KV memory in bytes (default: every slot at
    `max_seq_len`).  A request is admitted only while `watermark` of the
    pages would stay free or reclaimable.  `map_ahead` maps the pages the next
    step needs on a background thread while the current step computes.
    `layout`, `page_size`, `deferred_reclamation` and the other fields
    `CacheConfig` has too are the cache's (`cache_config`); on CUDA the pool
    takes at most `gpu_memory_utilization` of the free device memory unless
    `memory_budget` says.  With `enable_prefix_caching` a prompt resumes the
    whole pages another request computed for the same tokens.
    `kv_cache="paged"` runs the same engine on the paged baseline
    (`vattn.PagedKVCache`, blocks of `block_size` tokens).  With `kv_pool`
    (a `vattn.PoolMember`) the virtual cache draws on a pool shared with
    other models' engines (`vattn.kv.shared`), whose budget is then the
    memory budget.

    `dtype` is the one the model is served in ("auto", "float32",
    "bfloat16", "float16": `vattn.dtypes`): `vattn.LLM` loads it so, and a
    model given loaded must be in it ("auto": any).

    How the model runs (`runner_options`, `vattn.executor.runner.RunnerOptions`,
    where the rules of which apply live): `attention` names the attention
    kernel (`vattn.attention.registry.KERNELS`: "native", "flash", "triton",
    "sdpa"; None: the first that serves the cache).  `pack_linears` pre-packs
    the model's linear weights on the CPU (for vattn's own GEMM,
    `vattn.executor.gemm`, where it serves their dtype and `native_gemm`; the
    others for oneDNN) and `fuse_projections` runs Q/K/V and gate/up as one
    GEMM each where the architecture is known (`vattn.executor.linears`); the
    model is given back unchanged by `close()`.  `own_forward` runs the
    architectures `vattn.executor.forward` knows through the engine's own
    forward over the model's modules (transformers' arithmetic without its
    per-call machinery); other models run their own forward.  With
    `fuse_elementwise` that forward runs its work between the GEMMs on
    float32 or bfloat16 rows on the host as one call into the C core each
    (equal to transformers' within float32 rounding, not bit for bit).  `compile` runs
    the model through `torch.compile` (one graph for every step, compiled by
    the first; inductor's freezing packs the weights, so `pack_linears`,
    `fuse_projections`, `own_forward` and `fuse_elementwise` do not apply).
    `tensor_parallel_size` ranks each hold a share of the model's heads and
    a cache of their own KV heads (`vattn.distributed`; its linears and
    forward stay transformers', so `pack_linears`, `fuse_projections`,
    `own_forward` and `fuse_elementwise` do not apply, nor does `compile`);
    `memory_budget` is then each rank's."""

    dtype: str | torch.dtype = "auto"
    max_num_seqs: int = 64  # the batch limits `vattn bench sweep` found fastest (benchmarks/README.md)
    max_num_batched_tokens: int = 512
    max_running_tokens: int | None = 32768  # 29% less KV for 2% of the long chats' tokens/s (benchmarks/README.md)
    max_seq_len: int | None = None
    allow_long_max_seq_len: bool = False
    memory_budget: int | None = None
    page_size: int | None = None
    layout: str | None = None
    gpu_memory_utilization: float = 0.9
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    map_ahead: bool = True
    deferred_reclamation: bool = True
    kv_cache: str = "virtual"
    block_size: int = 16
    attention: str | None = None
    pack_linears: bool = True
    fuse_projections: bool = True
    own_forward: bool = True
    fuse_elementwise: bool = True
    native_gemm: bool = True
    compile: bool = False
    tensor_parallel_size: int = 1
    kv_pool: PoolMember | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_running_tokens", "max_seq_len", "block_size",
                     "tensor_parallel_size"):
            value, optional = getattr(self, name), name in ("max_running_tokens", "max_seq_len")  # None: default
            if (value is not None or not optional) and not (is_int(value) and value > 0):
                raise ValueError(f"EngineConfig.{name} must be a positive int{' or None' * optional}, got {value!r}")
        for name in ("allow_long_max_seq_len", "enable_prefix_caching", "map_ahead", "deferred_reclamation",
                     "pack_linears", "fuse_projections", "own_forward", "fuse_elementwise", "native_gemm", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        try:
            dtypes.check(self.dtype)
        except ValueError as e:
            raise ValueError(f"EngineConfig.{e}") from None
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"EngineConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"EngineConfig.kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        check_utilization("EngineConfig", self.gpu_memory_utilization)
        if not (is_number(self.watermark) and 0 <= self.watermark < 1):
            raise ValueError(f"EngineConfig.watermark must be in [0, 1), got {self.watermark!r}")
        if self.compile and self.tensor_parallel_size > 1:
            raise ValueError("EngineConfig.compile does not run under tensor parallelism (tensor_parallel_size > 1)")
        if self.kv_pool is not None:
            if not isinstance(self.kv_pool, PoolMember):
                raise ValueError(f"EngineConfig.kv_pool must be a vattn.PoolMember (KVPool.add), "
                                 f"got {type(self.kv_pool).__name__}")
            if self.memory_budget is not None:
                raise ValueError("EngineConfig.memory_budget and kv_pool exclude each other: the pool's budget is "
                                 "the memory budget")
            if self.kv_cache != "virtual" or self.tensor_parallel_size > 1:
                raise ValueError("EngineConfig.kv_pool serves the virtual cache (kv_cache='virtual') of one rank")

    def for_model(self, model) -> "EngineConfig":
        """These settings with `max_seq_len` set for `model`, whose positions
        (`max_position_embeddings`, where its config has them) bound it."""
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if self.max_seq_len is None:
            return dataclasses.replace(self, max_seq_len=min(DEFAULT_MAX_SEQ_LEN, positions or DEFAULT_MAX_SEQ_LEN))
        if positions and self.max_seq_len > positions and not self.allow_long_max_seq_len:
            raise ValueError(f"EngineConfig.max_seq_len={self.max_seq_len} is more than the model's "
                             f"max_position_embeddings={positions}; set allow_long_max_seq_len=True if the "
                             f"model is good past its positions")
        return self

    def cache_config(self, model) -> CacheConfig:
        """The cache these settings build for `model` (its layers, this rank's
        KV heads, head size, dtype, device, and the settings of `CacheConfig`
        this config has too, but `dtype`: the cache holds the model's)."""
        shared = self._shared(CacheConfig)
        del shared["dtype"]
        return CacheConfig.from_model(model, self.tensor_parallel_size, **shared)

    def runner_options(self, sharded: bool) -> RunnerOptions:
        """How the model runs (`sharded`: this rank holds a tensor-parallel
        shard), GEMMs of about `max_num_seqs` rows."""
        return RunnerOptions(**self._shared(RunnerOptions), sharded=sharded, rows=self.max_num_seqs)

    def _shared(self, other) -> dict:
        """This config's values of the fields dataclass `other` has too: one
        path to the other configs, no field copied by hand."""
        mine = {f.name for f in dataclasses.fields(self)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(other) if f.name in mine}
