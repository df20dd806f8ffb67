"""Which kernel runs the engine's attention: one table, in order of preference.

A kernel serves some device types, dtypes, cache kinds (`kind` of the cache
class: "virtual" hands kernels whole-buffer views, "paged" gathers rows
through block tables or hands the tables over), paged block sizes and head
dims.  FlashAttention and the Triton decode kernel need optional packages
(flash-attn, triton); vattn's own CPU kernel (`native`) is part of the C
core.
"""
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

import vattn.attention.flash as flash
import vattn.attention.native as native
import vattn.attention.sdpa as sdpa
import vattn.attention.triton_decode as triton_decode
import vattn.binding as binding


@dataclass(frozen=True, slots=True)
class Kernel:
    name: str
    prepare: Callable  # (batch, data) -> the forward's calls: `.run(layer, q, k, v, scaling, window, out)`
    stores_kv: bool  # it appends the step's K/V itself: the cache only checks and records the write
    device_types: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    cache_kinds: tuple[str, ...]
    head_dims: Callable[[int], bool] | None = None  # None: any
    head_dims_text: str = ""
    block_sizes: Callable[[int], bool] | None = None  # of a paged cache; None: any
    block_sizes_text: str = ""
    package: str | None = None  # the optional package it needs
    installed: bool = True  # whether that package is here
    range_read: Callable | None = None  # (batch) -> (lo, hi, length) it reads whole, or None (`sdpa.range_read`)

    def serves(self, device_type: str, dtype: torch.dtype, cache_kind: str, head_dim: int,
               block_size: int | None = None) -> bool:
        return self.serves_but_head_dim(device_type, dtype, cache_kind, block_size) and (
            self.head_dims is None or self.head_dims(head_dim))

    def serves_but_head_dim(self, device_type: str, dtype: torch.dtype, cache_kind: str,
                            block_size: int | None = None) -> bool:
        return (device_type in self.device_types and (self.dtypes is None or dtype in self.dtypes)
                and cache_kind in self.cache_kinds
                and (cache_kind != "paged" or self.block_sizes is None
                     or (block_size is not None and self.block_sizes(block_size))))

    def describe(self) -> str:
        dtypes = "any dtype" if self.dtypes is None else "/".join(map(_dtype_name, self.dtypes))
        return (f"{'/'.join(self.device_types)}, {dtypes}, {'/'.join(self.cache_kinds)} caches"
                f"{self.block_sizes_text}{self.head_dims_text}")


KERNELS = {k.name: k for k in (
    Kernel("native", native.NativeStep, stores_kv=True, device_types=("cpu",), dtypes=tuple(binding.DTYPES),
           cache_kinds=("virtual",), head_dims=native.serves_head_dim,
           head_dims_text=f", head_dim a multiple of 16 up to {native.MAX_HEAD_DIM}"),
    Kernel("flash", flash.FlashStep, stores_kv=True, device_types=("cuda",), dtypes=(torch.float16, torch.bfloat16),
           cache_kinds=("virtual", "paged"), head_dims=flash.serves_head_dim,
           head_dims_text=f", head_dim a multiple of 8 up to {flash.MAX_HEAD_DIM}", package="flash-attn",
           installed=flash.AVAILABLE, block_sizes=flash.serves_block_size,
           block_sizes_text=f" (paged: blocks a multiple of {flash.BLOCK_MULTIPLE} tokens)"),
    Kernel("triton", triton_decode.TritonStep, stores_kv=False, device_types=("cuda",),
           dtypes=(torch.float16, torch.bfloat16, torch.float32), cache_kinds=("virtual",),
           head_dims=triton_decode.serves_head_dim, head_dims_text=f", head_dim up to {triton_decode.MAX_HEAD_DIM}",
           package="triton", installed=triton_decode.AVAILABLE),
    Kernel("sdpa", sdpa.SdpaStep, stores_kv=False, device_types=("cpu", "cuda"), dtypes=None,
           cache_kinds=("virtual", "paged"), range_read=sdpa.range_read),
)}


INSTALLED = frozenset(k.name for k in KERNELS.values() if k.installed)


def pick_for(cache, name: str | None = None) -> Kernel:
    """`pick` for a cache of vattn (its device, dtype, kind, head dim and block size)."""
    c = cache.config
    return pick(cache.device.type, c.dtype, cache.kind, c.head_dim, name, block_size=getattr(cache, "block_size", None))


@cache  # asked once per layer per step
def pick(device_type: str, dtype: torch.dtype, cache_kind: str, head_dim: int, name: str | None = None, *,
         block_size: int | None = None, installed: frozenset[str] = INSTALLED) -> Kernel:
    """The kernel `name`, or (None) the first in `KERNELS` that serves this
    device type, dtype, cache kind (and a paged cache's `block_size`) and head
    dim, with a warning for any kernel ahead of it passed over for the head
    dim alone; a ValueError if it cannot.  `installed`: the kernels whose code
    is here."""
    if name is not None and name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; the kernels are {', '.join(map(repr, KERNELS))}")
    here = [k for k in KERNELS.values() if k.name in installed]
    serving = [k for k in here if k.serves(device_type, dtype, cache_kind, head_dim, block_size)]
    for kernel in serving:
        if name in (None, kernel.name):
            if name is None:
                _say_why_not(device_type, dtype, cache_kind, head_dim, block_size, kernel, here)
            return kernel
    wanted = [KERNELS[name]] if name else list(KERNELS.values())
    reasons = "; ".join(f"{k.name!r} serves {k.describe()}" for k in wanted)
    reasons += "".join(f"; {k.package} is not installed" for k in wanted if k.name not in installed)
    whom = "no attention kernel serves" if name is None else f"attention kernel {name!r} cannot serve"
    blocks = "" if block_size is None else f" of {block_size}-token blocks"
    raise ValueError(f"{whom} {device_type}, {_dtype_name(dtype)}, a {cache_kind} cache{blocks}, head_dim {head_dim} "
                     f"({reasons}); "
                     f"the kernels that can: {', '.join(repr(k.name) for k in serving) or 'none'}")


def _say_why_not(device_type, dtype, cache_kind, head_dim, block_size, chosen: Kernel, here: list[Kernel]) -> None:
    """Warn of each kernel ahead of `chosen` that would serve but for the head dim."""
    for k in here:
        if k is chosen:
            return
        if k.serves_but_head_dim(device_type, dtype, cache_kind, block_size):
            warnings.warn(f"attention kernel {k.name!r} does not take head_dim {head_dim} ({k.describe()}); "
                          f"running {chosen.name!r}", stacklevel=3)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
