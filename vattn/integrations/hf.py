"""A Hugging Face `Cache` backed by the virtual KV cache.

`VAttnCache` drops into `model.generate(..., cache=VAttnCache.from_model(model,
max_num_seqs=..., max_seq_len=...))` (transformers ≥ 5.24; before 5.24 the keyword
is `past_key_values=`).  Batch row i lives in slot i of one `VirtualKVCache`;
every layer writes its new K/V in place and gets back strided views over the
live tokens, `[batch, kv_heads, tokens, head_dim]`, with no copy.  Beam
reordering, `batch_select_indices` and `batch_repeat_interleave` remap pages
(sharing them) instead of copying the history.

On the host the model should run `attn_implementation="vattn_native"`
(`VAttnCache.attn_implementation` names it): vattn's own kernel reads those
views in place, each row from its first unpadded token.
"""
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import vattn.binding as binding
from vattn.attention import registry
from vattn.attention.native import serves_head_dim
from vattn.config import CacheConfig
from vattn.kv.virtual import VirtualKVCache

NATIVE = "vattn_native"


class KVMemoryError(MemoryError):
    """The cache's memory budget cannot hold what the model asked to store."""


class VAttnLayer(CacheLayerMixin):
    is_sliding = False  # every token is kept; the model's mask applies any sliding window
    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "VAttnCache", layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.cache.store(self.layer_idx, key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.kv.length(0, self.layer_idx) if self.cache.rows else 0

    def get_max_length(self) -> int:
        return self.cache.kv.config.max_seq_len

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class VAttnCache(Cache):
    def __init__(self, config: CacheConfig):
        self.kv = VirtualKVCache(config)
        self.kernel = registry.pick_for(self.kv)
        super().__init__(layers=[VAttnLayer(self, i) for i in range(config.num_layers)])
        self.rows = 0  # batch rows; row i is slot i
        self._capacity = 0  # tokens every row is sized for (kept here: it is checked on every update)

    @property
    def attn_implementation(self) -> str:
        """The transformers attention a model should run over this cache's views
        (`store` returns them): the kernel the registry picks for the cache's
        device, dtype, kind and head dim, as transformers names it (vattn's
        own is `native_attention`, registered as "vattn_native")."""
        return {"native": NATIVE, "flash": "flash_attention_2"}.get(self.kernel.name, "sdpa")

    @classmethod
    def from_model(cls, model, max_num_seqs: int, max_seq_len: int, *, layout: str | None = None,
                   page_size: int | None = None, memory_budget: int | None = None) -> "VAttnCache":
        """A cache with the geometry, dtype and device of `model`; layout and
        page size default to the device's (`vattn.config.DEFAULTS`: on the host
        the per-head layout hands attention `[batch, heads, tokens, head_dim]`
        views whose rows are contiguous, as transformers' own caches do)."""
        return cls(CacheConfig.from_model(model, max_num_seqs=max_num_seqs, max_seq_len=max_seq_len, layout=layout,
                                          page_size=page_size, memory_budget=memory_budget))

    # ------------------------------------------------------------ the model's writes

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"the model has a layer {layer_idx}; this cache was built for {len(self.layers)} layers")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H, T, D]` new K/V of `layer` after its history; views over everything."""
        c = self.kv.config
        B, H, T, D = key.shape
        if (H, D, key.dtype) != (c.num_kv_heads, c.head_dim, c.dtype):
            raise ValueError(f"the model gives K/V of {H} heads × {D} dims in {key.dtype}; this cache was built "
                             f"for {c.num_kv_heads} × {c.head_dim} in {c.dtype} (use VAttnCache.from_model)")
        if not self.rows:
            self._open(B)
        elif B != self.rows:
            raise ValueError(f"the batch has {B} rows; this cache holds {self.rows}")
        start = self.kv.length(0, layer)
        end = start + T
        if end > c.max_seq_len:
            raise ValueError(f"the sequence would reach {end} tokens; this cache holds at most "
                             f"max_seq_len={c.max_seq_len}")
        if end > self._capacity:
            if not self.kv.grow_many({row: end for row in range(B)}):
                raise KVMemoryError(f"the KV memory budget cannot hold {B} rows of {end} tokens "
                                    f"({self.kv.stats().pages_free} pages free)")
            self._capacity = end
        self.kv.data.write(layer, range(B), [start] * B, key.transpose(1, 2), value.transpose(1, 2))
        K, V = self.kv.data.views(layer)
        return K[:B, :end].transpose(1, 2), V[:B, :end].transpose(1, 2)

    def _open(self, batch: int) -> None:
        if batch > self.kv.config.max_num_seqs:
            raise ValueError(f"the batch has {batch} rows; this cache was built for max_num_seqs="
                             f"{self.kv.config.max_num_seqs}")
        for row in range(batch):
            if self.kv.allocate(1, slot=row) is None:
                self._close()
                raise KVMemoryError(f"the KV memory budget cannot hold {batch} rows")
            self.rows += 1
        self._capacity = min(self.kv.capacity(row) for row in range(batch))

    def _close(self) -> None:
        for row in range(self.rows):
            self.kv.free(row)
        self.rows = self._capacity = 0

    # ------------------------------------------------------------ what generate() asks of a cache

    def reset(self) -> None:
        self._close()
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues row `beam_idx[i]`: full pages are remapped, tail pages copied."""
        self._remap([int(i) for i in beam_idx])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, in that order."""
        indices = [int(i) for i in indices]
        self._remap(indices)
        for row in range(len(indices), self.rows):
            self.kv.free(row)
        self.rows = min(self.rows, len(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes `repeats` rows that share its pages."""
        if not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be a positive int, got {repeats!r}")
        if not self.rows or repeats == 1:
            return
        new_rows = self.rows * repeats
        if new_rows > self.kv.config.max_num_seqs:
            raise ValueError(f"repeating {self.rows} rows {repeats} times needs {new_rows} slots; this cache "
                             f"was built for max_num_seqs={self.kv.config.max_num_seqs}")
        n = self.get_seq_length()
        forked = []  # forks first: they read the rows before those move
        while len(forked) < new_rows - self.rows:
            row = self.rows + len(forked)
            if self.kv.fork(row // repeats, n, slot=row) is None:
                break
            forked.append(row)
        if len(forked) < new_rows - self.rows or not self.kv.share_many(
                {row: row // repeats for row in range(1, self.rows)}, n):
            for row in forked:
                self.kv.free(row)
            raise KVMemoryError(f"the KV memory budget cannot hold {new_rows} rows of {n} tokens")
        self.rows = new_rows
        self._capacity = min(self.kv.capacity(row) for row in range(new_rows))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: how many tokens to remove")
        if not self.rows or tokens_to_remove == 0:
            return
        n = self.get_seq_length() + tokens_to_remove
        if n <= 0:
            return self.reset()
        if not self.kv.share_many({row: row for row in range(self.rows)}, n):
            raise KVMemoryError("the KV memory budget cannot hold the cropped rows' tail pages")
        self._capacity = n

    def _remap(self, sources: list[int]) -> None:
        if not self.rows:
            return
        if len(sources) > self.rows or any(not 0 <= s < self.rows for s in sources):
            raise ValueError(f"row indices {sources} do not fit a cache of {self.rows} rows")
        moves = {row: src for row, src in enumerate(sources) if row != src}
        if moves and not self.kv.share_many(moves, self.get_seq_length()):
            raise KVMemoryError("the KV memory budget cannot hold the reordered rows' tail pages")
        self._capacity = min(self.kv.capacity(row) for row in range(len(sources)))

    def stats(self):
        return self.kv.stats()



def native_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     **kwargs):
    """transformers' attention interface over `VAttnCache`'s views: `key`/`value
    [B, H_kv, L, D]` are the cache's own rows, read in place by the native
    kernel, row b from its first unmasked token.  What that cannot express
    (a mask other than a left-padded causal band, dropout, soft-capping,
    sinks, a dtype or head dim it does not take) runs on transformers' SDPA."""
    B, H, T, D = query.shape
    L = key.shape[2]
    starts = _band_starts(attention_mask, B, T, L, sliding_window)
    if (starts is None or dropout or kwargs.get("softcap") or kwargs.get("s_aux") is not None
            or query.dtype not in binding.DTYPES or not serves_head_dim(D) or query.device.type != "cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      sliding_window=sliding_window, **kwargs)
    table = binding.request_table((b, start, L, b * T, T) for b, start in enumerate(starts))
    out = binding.attend(query.transpose(1, 2).reshape(B * T, H, D), key.transpose(1, 2), value.transpose(1, 2),
                        table, D ** -0.5 if scaling is None else scaling, sliding_window)
    return out.view(B, T, H, D), None


def _band_starts(mask, B: int, T: int, L: int, window: int | None) -> list[int] | None:
    """Row b's first key where `mask [B, 1, T, L]` is the causal band of
    queries at L - T.. over keys from there (within `window`), else None."""
    if T > L:
        return None
    if mask is None:
        return [0] * B
    if mask.dtype != torch.bool or mask.shape != (B, 1, T, L):
        return None
    first = mask[:, 0, 0].int().argmax(-1)  # the first query's first key
    keys = torch.arange(L, device=mask.device)
    queries = torch.arange(L - T, L, device=mask.device)[:, None]
    band = (keys >= first[:, None, None]) & (keys <= queries)
    if window is not None:
        band &= keys > queries - window
    return first.tolist() if torch.equal(band, mask[:, 0]) else None


AttentionInterface.register(NATIVE, native_attention)
AttentionMaskInterface.register(NATIVE, sdpa_mask)
