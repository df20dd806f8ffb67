"""The KV caches: the page pool, the slot bookkeeping over a storage (virtual
buffers or a paged pool) with its data plane, the physical pool several
caches may share (`KVPool`), and the cache API a scheduler uses
(`KVCacheManager`)."""
from vattn.config import CacheConfig
from vattn.kv.manager import KVCacheManager
from vattn.kv.paged import PagedKVCache
from vattn.kv.pool import PagePool
from vattn.kv.shared import KVPool, PoolMember
from vattn.kv.sharing import SwappedSlot
from vattn.kv.slots import SlotCache
from vattn.kv.stats import CacheStats
from vattn.kv.virtual import VirtualKVCache

__all__ = ["CacheStats", "KVCacheManager", "KVPool", "PagePool", "PagedKVCache", "PoolMember", "SlotCache",
           "SwappedSlot", "VirtualKVCache", "make_cache"]


def make_cache(config: CacheConfig, kind: str = "virtual", block_size: int = 16,
               member: PoolMember | None = None) -> SlotCache:
    """A cache of `config`'s geometry: the virtual cache (drawing on a shared
    pool's `member`, where one is given), or (`kind` "paged") the paged
    baseline in blocks of `block_size` tokens."""
    if kind == "paged":
        if member is not None:
            raise ValueError("a shared pool serves the virtual cache, not the paged one")
        return PagedKVCache(config, block_size)
    return VirtualKVCache(config, member=member)
