"""The KV caches: the page pool, the slot bookkeeping over a storage (virtual
buffers or a paged pool), and the cache API a scheduler uses (`KVCacheManager`)."""
from vattn.kv.inspect import CacheStats
from vattn.kv.manager import KVCacheManager
from vattn.kv.paged import PagedKVCache
from vattn.kv.pool import PagePool
from vattn.kv.sharing import SwappedSlot
from vattn.kv.slots import SlotCache
from vattn.kv.virtual import VirtualKVCache

__all__ = ["CacheStats", "KVCacheManager", "PagePool", "PagedKVCache", "SlotCache", "SwappedSlot", "VirtualKVCache"]
