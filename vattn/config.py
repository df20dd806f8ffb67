"""Cache geometry and the arithmetic between tokens, bytes and pages."""
from dataclasses import dataclass
from typing import Literal

import torch

MiB = 1 << 20
LAYOUTS = ("per_layer", "per_head", "interleaved")


@dataclass(slots=True)
class CacheConfig:
    """Geometry of a virtual KV cache.

    Every layout is virtually contiguous along the sequence:
    - `"per_layer"` keeps 2·L buffers `[max_batch, max_seq_len, H, D]`
      (vAttention's default; FlashAttention's layout);
    - `"per_head"` keeps 2·L·H buffers `[max_batch, max_seq_len, D]`, so a
      layer's K is `[max_batch, H, max_seq_len, D]` with each head's tokens
      contiguous, the layout torch SDPA, eager attention and transformers use;
    - `"interleaved"` keeps one buffer `[max_batch, max_seq_len, L, 2, H, D]`, so
      a page holds every layer's K and V of a few tokens and large pages still
      give fine granularity.
    `layout` and `page_size` default to `"per_layer"` and 2 MiB on the host,
    and on CUDA to `"interleaved"` and the driver's page granularity (2 MiB on
    current GPUs), so a page still holds only a few tokens.  `memory_budget`
    is the physical KV memory in bytes (default: enough for every slot at
    `max_seq_len`; on CUDA at most `gpu_memory_utilization` of the free
    device memory).  With `deferred_reclamation` a finished request's pages
    stay mapped for the next one; without it they are unmapped at once.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    max_batch: int = 8
    max_seq_len: int = 2048
    page_size: int | None = None
    layout: Literal["per_layer", "per_head", "interleaved"] | None = None
    memory_budget: int | None = None
    device: str = "cpu"
    deferred_reclamation: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        try:
            cuda = torch.device(self.device).type == "cuda"
        except (RuntimeError, TypeError):
            raise ValueError(f"CacheConfig.device must name a torch device, got {self.device!r}") from None
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization!r}")
        backend = _backend(self.device) if cuda and (self.page_size is None or self.memory_budget is None) else None
        if self.layout is None:
            self.layout = "interleaved" if cuda else "per_layer"
        if self.page_size is None:
            self.page_size = backend.granularity if cuda else 2 * MiB
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_batch", "max_seq_len", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheConfig.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"CacheConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if cuda and self.memory_budget is None:
            free, _ = backend.memory()
            self.memory_budget = min(self.max_batch * self.pages_per_slot * self.page_group_bytes,
                                     int(self.gpu_memory_utilization * free))
        if self.memory_budget is not None and self.memory_budget < self.page_group_bytes:
            raise ValueError(f"CacheConfig.memory_budget={self.memory_budget} is smaller than one page group "
                             f"({self.page_group_bytes} bytes: one {self.page_size}-byte page in each of "
                             f"{self.num_buffers} buffers)")

    @property
    def num_buffers(self) -> int:
        return {"per_layer": 2 * self.num_layers, "per_head": 2 * self.num_layers * self.num_kv_heads,
                "interleaved": 1}[self.layout]

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in one buffer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize // self.num_buffers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token takes across all layers."""
        return self.token_bytes * self.num_buffers

    @property
    def page_group_bytes(self) -> int:
        """A page group: page j of a slot in every buffer, mapped together."""
        return self.page_size * self.num_buffers

    @property
    def pages_per_slot(self) -> int:
        return self.pages_for(self.max_seq_len)

    @property
    def slot_bytes(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def num_page_groups(self) -> int:
        """Page groups the memory budget buys."""
        if self.memory_budget is None:
            return self.max_batch * self.pages_per_slot
        return self.memory_budget // self.page_group_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages (per buffer) that hold `tokens` tokens."""
        return -(-tokens * self.token_bytes // self.page_size)


def _backend(device: str):
    from vattn.backends import get_backend

    return get_backend(device)
