"""vattn: a KV cache in virtually contiguous memory with physical pages mapped on demand."""
from vattn.backends import Backend, get_backend
from vattn.cache import CacheStats, SwappedSlot, VirtualKVCache
from vattn.config import CacheConfig
from vattn.page_pool import PagePool

__all__ = ["Backend", "CacheConfig", "CacheStats", "PagePool", "SwappedSlot", "VirtualKVCache", "get_backend"]
__version__ = "0.1.0"
