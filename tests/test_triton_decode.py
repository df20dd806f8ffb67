"""The Triton decode kernel (`vattn.attention.triton_decode`) run by Triton's
interpreter on host tensors, against SDPA on the same K/V: every layout's
strides, grouped heads, mixed lengths, windows, every row past a slot's
length poisoned.  The SDPA fallback it replaces, over a cache with no zero
page."""
import os

import pytest
import torch

from test_native_attention import close, reference
from test_zero_fill import HostWithoutZeroPage

from vattn.attention.batch import StepBatch
from vattn.attention.sdpa import SdpaStep
from vattn.binding import request_table
from vattn.config import CacheConfig
from vattn.kv.virtual import VirtualKVCache

triton = pytest.importorskip("triton", reason="triton is not installed (it comes with vattn[cuda])")
from vattn.attention import triton_decode  # noqa: E402  (after the skip: it needs triton)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="host tensors need Triton's interpreter, which conftest turns on only where "
                                       "there is no GPU (on one, tests/test_cuda.py runs the compiled kernel)")


def cache_with(lengths, layout, heads_kv, dim, dtype, seed=0, backend=None) -> VirtualKVCache:
    """Slot i holds `lengths[i]` random tokens in both layers and maps pages for no more."""
    config = CacheConfig(2, heads_kv, dim, dtype, max_num_seqs=len(lengths), max_seq_len=1024, layout=layout)
    cache = VirtualKVCache(config, backend)
    g = torch.Generator().manual_seed(seed)
    for slot, n in enumerate(lengths):
        assert cache.allocate(n, slot=slot) == slot
        for layer in range(2):
            k, v = (torch.randn(1, n, heads_kv, dim, generator=g).to(dtype) for _ in "kv")
            cache.data.write(layer, [slot], [0], k, v)
    return cache


def poisoned_copy(cache, lengths) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's K and V views, with their layout's strides, over a copy of the
    reservation in ordinary memory whose every row past a slot's length is NaN:
    a row read beyond a request's length spoils its output.  (The interpreter
    copies each argument's whole storage, which over a reservation would read
    what is not mapped.)"""
    storage = cache.storage
    copy = storage.bytes.clone()
    views = []
    for view in (storage.k[1], storage.v[1]):
        offset = (view.data_ptr() - storage.bytes.data_ptr()) // view.element_size()
        views.append(copy.view(-1).view(view.dtype).as_strided(view.shape, view.stride(), offset))
    for slot, n in enumerate(lengths):
        for view in views:
            view[slot, n:] = float("nan")
    return tuple(views)


def sdpa_reference(q, cache, slots, lengths, scale, window=None) -> torch.Tensor:
    """SDPA in float32, token i over the first `lengths[i]` rows of layer 1 of slot `slots[i]`."""
    K, V = cache.data.views(1)
    table = request_table((slot, 0, n, i, 1) for i, (slot, n) in enumerate(zip(slots, lengths)))
    return reference(q, K, V, table, scale, window)


@pytest.mark.parametrize("layout", ["per_layer", "per_head", "interleaved"])
@pytest.mark.parametrize("heads, heads_kv, dim", [(9, 3, 64), (4, 4, 32), (8, 1, 80), (6, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_sdpa_reading_only_each_slots_own_rows(layout, heads, heads_kv, dim, dtype):
    """Lengths inside one softmax block, across blocks and across pages; slots out of order."""
    lengths = [1, 300, 64, 129, 17]
    cache = cache_with(lengths, layout, heads_kv, dim, dtype)
    slots = [3, 0, 4, 1, 2]
    mine = [lengths[s] for s in slots]
    q = torch.randn(len(slots), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    K, V = poisoned_copy(cache, lengths)
    out = triton_decode.decode(q, K, V, torch.tensor(slots, dtype=torch.int32), torch.tensor(mine, dtype=torch.int32),
                               dim ** -0.5)
    assert close(out, sdpa_reference(q, cache, slots, mine, dim ** -0.5), dtype)


@pytest.mark.parametrize("window", [1, 50, 64, 1000])
def test_sliding_windows_equal_sdpa(window):
    lengths = [200, 64, 3]
    cache = cache_with(lengths, "per_layer", 2, 32, torch.float32)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2))
    K, V = poisoned_copy(cache, lengths)
    out = triton_decode.decode(q, K, V, torch.arange(3, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32),
                               0.2, window)
    assert close(out, sdpa_reference(q, cache, [0, 1, 2], lengths, 0.2, window), torch.float32)


def test_sdpa_over_a_cache_without_a_zero_page_decodes_request_by_request_and_counts_it():
    """Where the shorter slots map no row as far as the longest request reads,
    one batched SDPA call would fault: SDPA takes one call per request over its
    own rows, and the step counts the fallback (the Triton kernel's reason)."""
    lengths = [40, 300, 1, 129]
    cache = cache_with(lengths, "interleaved", 3, 64, torch.float32, backend=HostWithoutZeroPage())
    assert not cache.storage.zero_backed and not cache.data.readable(0, 4, 300)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 9, 64, generator=g)
    b = StepBatch([0, 1, 2, 3], [n - 1 for n in lengths], [])
    step = SdpaStep(b, cache.data)
    out = step.decode(1, q, 0.125, None)
    assert step.per_request_decodes == 1
    assert close(out, sdpa_reference(q, cache, [0, 1, 2, 3], lengths, 0.125), torch.float32)
    zero_backed = SdpaStep(b, cache_with(lengths, "interleaved", 3, 64, torch.float32).data)
    assert close(zero_backed.decode(1, q, 0.125, None), out, torch.float32)
    assert zero_backed.per_request_decodes == 0  # one call over the zero-backed range


def test_inputs_that_do_not_fit_are_refused_before_anything_runs():
    cache = cache_with([10, 10], "per_layer", 2, 32, torch.float32)
    K, V = poisoned_copy(cache, [10, 10])
    slots, lengths = torch.arange(2, dtype=torch.int32), torch.tensor([10, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="H_kv dividing 5"):
        triton_decode.decode(torch.zeros(2, 5, 32), K, V, slots, lengths, 1.0)
    with pytest.raises(ValueError, match="must be \\[2, 4, 32\\], \\[2\\], \\[2\\]"):
        triton_decode.decode(torch.zeros(2, 4, 32), K, V, slots[:1], lengths, 1.0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        triton_decode.decode(torch.zeros(2, 32, 4).transpose(1, 2), K, V, slots, lengths, 1.0)
    for bad_slots, bad_lengths in ((torch.tensor([0, 2]), lengths), (slots, torch.tensor([0, 10])),
                                   (slots, torch.tensor([10, 1025]))):
        with pytest.raises(ValueError, match="slots must be in \\[0, 2\\) and lengths in \\[1, 1024\\]"):
            triton_decode.decode(torch.zeros(2, 4, 32), K, V, bad_slots.int(), bad_lengths.int(), 1.0)
