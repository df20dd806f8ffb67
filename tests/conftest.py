import mmap
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton has nothing to compile for: its kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is imported

from vattn import CacheConfig, PagedKVCache, VirtualKVCache

# 96 bytes a token per buffer: tokens straddle 4 KiB page boundaries.
GEOMETRY = dict(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32)


def make_cache(layout="per_layer", max_num_seqs=4, max_seq_len=200, page_size=4096, pages=None, block_size=16, **kw):
    """A small cache (layout "paged": the paged baseline with `block_size`); `pages` sets the
    memory budget in page groups (blocks), `kw` overrides the geometry."""
    paged = layout == "paged"
    config = CacheConfig(**{**GEOMETRY, **kw}, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, page_size=page_size,
                         layout="per_layer" if paged else layout)
    if pages is not None:
        config.memory_budget = pages * (block_size * config.kv_bytes_per_token if paged else config.page_bytes)
    return PagedKVCache(config, block_size) if paged else VirtualKVCache(config)


@pytest.fixture(params=["per_layer", "per_head", "interleaved"])
def layout(request):
    return request.param


def fill(cache: VirtualKVCache, slot: int, num_tokens: int, start: int = 0, seed: int = 0):
    """Write `num_tokens` random tokens at `start` in every layer; returns [(k, v)] per layer."""
    c = cache.config
    g = torch.Generator().manual_seed(seed)
    written = []
    for layer in range(c.num_layers):
        k, v = (torch.randn(1, num_tokens, c.num_kv_heads, c.head_dim, generator=g, dtype=c.dtype) for _ in "kv")
        cache.data.write(layer, [slot], [start], k, v)
        written.append((k[0], v[0]))
    return written


def physical_bytes(cache: VirtualKVCache, group: int, buffer: int) -> torch.Tensor:
    """A page's bytes read through a second mapping of the pool's memfd."""
    size = cache.config.page_size
    page = cache.storage._physical_pages([group])[buffer]
    with mmap.mmap(cache.storage.physical.fd, size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page * size) as m:
        return torch.frombuffer(bytearray(m), dtype=torch.uint8)


def state(cache: VirtualKVCache):
    """Everything a failed call must leave as it was."""
    return (list(cache.pool.refs), cache.pool.free_pages(), cache.pool.num_shared,
            [(s.pages[:], s.capacity, s.written[:], s.shared_pages, s.idle_since) for s in cache.table.slots],
            cache.map_calls, cache.unmap_calls, sorted(cache._swapped), cache.stats())


def live(cache, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[written, H, D]` K and V of the tokens the slot has written in `layer`:
    views of the virtual cache, copies of what the paged one gathers (into a
    buffer its next read reuses)."""
    k, v = cache.data.rows(layer, slot, slot + 1, cache.length(slot, layer))
    return (k[0], v[0]) if cache.kind == "virtual" else (k[0].clone(), v[0].clone())


def pytest_report_header(config) -> list[str]:
    """The code each kernel runs here: the paths these tests cover (the others run where the CPU has them)."""
    from vattn.executor.paths import kernel_paths

    return [f"{name}: {path}" for name, path in kernel_paths()]
