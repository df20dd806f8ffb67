"""Cache geometry, the arithmetic between tokens, bytes and pages, and the one
table of per-device defaults."""
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from vattn.checks import is_int, is_number

KiB, MiB = 1 << 10, 1 << 20
LAYOUTS = ("per_layer", "per_head", "interleaved")
# The defaults, per device type.  On the host the per-head layout reads like a
# contiguous `[batch, heads, tokens, dim]` tensor (what SDPA and transformers
# use) and 8 KiB pages keep it fine-grained; on CUDA the interleaved layout
# keeps a page of the driver's granularity (None here: 2 MiB on current GPUs)
# down to a few tokens.
DEFAULTS = {"cpu": dict(layout="per_head", page_size=8 * KiB),
            "cuda": dict(layout="interleaved", page_size=None)}


@dataclass(slots=True)
class CacheConfig:
    """Geometry of a KV cache: a plain record, checked, never probing a device.

    Every layout is virtually contiguous along the sequence:
    - `"per_layer"` keeps 2·L buffers `[max_num_seqs, max_seq_len, H, D]`
      (vAttention's default; FlashAttention's layout);
    - `"per_head"` keeps 2·L·H buffers `[max_num_seqs, max_seq_len, D]`, so a
      layer's K is `[max_num_seqs, H, max_seq_len, D]` with each head's tokens
      contiguous;
    - `"interleaved"` keeps one buffer `[max_num_seqs, max_seq_len, L, 2, H, D]`,
      so a page holds every layer's K and V of a few tokens.
    A *page* is the unit of allocation: page j of a slot in every buffer,
    mapped together; `page_size` is its size in one buffer.  `layout` and
    `page_size` left None take `DEFAULTS` of the device when a cache is built
    (`resolve`).  `memory_budget` is the physical KV memory in bytes (default:
    every slot at `max_seq_len`; on CUDA at most `gpu_memory_utilization` of
    the free device memory).  With `deferred_reclamation` a finished request's
    pages stay mapped for the next one; without it they are unmapped at once.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    max_num_seqs: int = 8
    max_seq_len: int = 2048
    page_size: int | None = None
    layout: Literal["per_layer", "per_head", "interleaved"] | None = None
    memory_budget: int | None = None
    device: str = "cpu"
    deferred_reclamation: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"CacheConfig.device must name a torch device, got {self.device!r}") from None
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_num_seqs", "max_seq_len", "page_size",
                     "memory_budget"):
            value = getattr(self, name)
            if value is None and name in ("page_size", "memory_budget"):
                continue
            if not is_int(value) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"CacheConfig.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"CacheConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_utilization("CacheConfig", self.gpu_memory_utilization)

    @classmethod
    def from_model(cls, model, tensor_parallel_size: int = 1, **settings) -> "CacheConfig":
        """The layers, KV heads (a rank's share of them, under tensor
        parallelism), head size, dtype and device of a transformers model;
        `settings` give the rest."""
        c = model.config.get_text_config()
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        return cls(num_layers=c.num_hidden_layers, num_kv_heads=kv_heads // tensor_parallel_size,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, dtype=model.dtype,
                   device=str(model.device), **settings)

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
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Physical memory of one page: `page_size` in each buffer."""
        return self.page_size * self.num_buffers

    @property
    def pages_per_slot(self) -> int:
        return self.pages_for(self.max_seq_len)

    @property
    def slot_bytes(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def num_pages(self) -> int:
        """Pages the memory budget buys."""
        if self.memory_budget is None:
            return self.max_num_seqs * self.pages_per_slot
        return self.memory_budget // self.page_bytes

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens."""
        return -(-tokens * self.token_bytes // self.page_size)

    def tokens_in(self, pages: int) -> int:
        """Tokens wholly inside the first `pages` pages: what a prefix-cache
        hit of that many pages gives (prefix caching works in whole pages)."""
        return pages * self.page_size // self.token_bytes


def check_utilization(owner: str, value) -> None:
    if not (is_number(value) and 0 < value <= 1):
        raise ValueError(f"{owner}.gpu_memory_utilization must be in (0, 1], got {value!r}")


def resolve(config: CacheConfig, backend=None) -> CacheConfig:
    """`config` with the device's defaults filled in (`DEFAULTS`; on CUDA the
    page size is the driver's granularity and the budget is capped by the free
    device memory).  The backend (by default the device's) checks the page
    size when it makes the pages."""
    if backend is None:
        from vattn.backends import get_backend

        backend = get_backend(config.device)
    defaults = DEFAULTS[backend.device.type]
    layout = config.layout or defaults["layout"]
    page_size = config.page_size or defaults["page_size"] or backend.granularity
    c = dataclasses.replace(config, layout=layout, page_size=page_size)
    if c.memory_budget is None and backend.device.type == "cuda":
        free, _ = backend.memory()
        c.memory_budget = min(c.max_num_seqs * c.pages_per_slot * c.page_bytes,
                              int(c.gpu_memory_utilization * free))
    if c.memory_budget is not None and c.memory_budget < c.page_bytes:
        raise ValueError(f"CacheConfig.memory_budget={c.memory_budget} is smaller than one page "
                         f"({c.page_bytes} bytes: {page_size} bytes in each of {c.num_buffers} buffers)")
    return c
