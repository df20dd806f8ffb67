"""vattn: a KV cache in virtually contiguous memory with physical pages mapped on demand."""
from vattn.backends import Backend, get_backend
from vattn.cache import CacheStats, SwappedSlot, VirtualKVCache
from vattn.config import CacheConfig
from vattn.page_pool import PagePool

__all__ = ["Backend", "CacheConfig", "CacheStats", "PagePool", "SwappedSlot", "VAttnCache", "VirtualKVCache",
           "get_backend"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "VAttnCache":  # imported on first use: it needs transformers (the `hf` extra)
        from vattn.hf import VAttnCache

        return VAttnCache
    raise AttributeError(f"module 'vattn' has no attribute {name!r}")
