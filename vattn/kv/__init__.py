"""The KV caches: the page pool, the slot bookkeeping and the two storages (virtual, paged)."""
