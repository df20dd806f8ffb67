"""vattn: a KV cache in virtually contiguous memory with physical pages mapped on demand."""
from vattn.backends import Backend, get_backend
from vattn.config import CacheConfig
from vattn.kv import (CacheStats, KVCacheManager, KVPool, PagedKVCache, PagePool, PoolMember, SwappedSlot,
                     VirtualKVCache)
from vattn.sampling_params import SamplingParams

__all__ = ["LLM", "Backend", "CacheConfig", "CacheStats", "EngineConfig", "KVCacheManager", "KVPool", "LLMEngine",
           "PagePool", "PagedKVCache", "PoolMember", "SamplingParams", "SwappedSlot", "VAttnCache", "VirtualKVCache",
           "get_backend"]
__version__ = "0.1.0"


_NEEDS_TRANSFORMERS = {"VAttnCache": "vattn.integrations.hf", "LLM": "vattn.llm", "LLMEngine": "vattn.engine",
                       "EngineConfig": "vattn.engine"}


def __getattr__(name):
    if name in _NEEDS_TRANSFORMERS:  # imported on first use: they need transformers (the `hf` extra)
        import importlib

        return getattr(importlib.import_module(_NEEDS_TRANSFORMERS[name]), name)
    raise AttributeError(f"module 'vattn' has no attribute {name!r}")
