"""The KV caches: the page pool, the slot bookkeeping over a storage (virtual
buffers or a paged pool) with its data plane, and the cache API a scheduler
uses (`KVCacheManager`)."""
from vattn.config import CacheConfig
from vattn.kv.manager import KVCacheManager
from vattn.kv.paged import PagedKVCache
from vattn.kv.pool import PagePool
from vattn.kv.sharing import SwappedSlot
from vattn.kv.slots import SlotCache
from vattn.kv.stats import CacheStats
from vattn.kv.virtual import VirtualKVCache

__all__ = ["CacheStats", "KVCacheManager", "PagePool", "PagedKVCache", "SlotCache", "SwappedSlot", "VirtualKVCache",
           "make_cache"]


def make_cache(config: CacheConfig, kind: str = "virtual", block_size: int = 16) -> SlotCache:
    """A cache of `config`'s geometry: the virtual cache, or (`kind` "paged")
    the paged baseline in blocks of `block_size` tokens."""
    return PagedKVCache(config, block_size) if kind == "paged" else VirtualKVCache(config)
