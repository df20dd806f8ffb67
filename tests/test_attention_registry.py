"""The attention registry's choice of kernel (device types given as strings: no GPU needed)."""
import pytest
import torch
from conftest import make_cache

from vattn.attention import registry
from vattn.attention.registry import pick

EVERY = frozenset(registry.KERNELS)  # as if flash-attn and triton were installed
NO_FLASH = EVERY - {"flash"}
NEITHER = EVERY - {"flash", "triton"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("installed", [EVERY, NEITHER])
def test_the_host_takes_the_native_kernel_for_virtual_caches(dtype, installed):
    kernel = pick("cpu", dtype, "virtual", 64, installed=installed)
    assert kernel.name == "native" and kernel.stores_kv  # one call appends and attends


@pytest.mark.parametrize("dtype, kind, head_dim", [(torch.float16, "virtual", 64), (torch.float32, "paged", 64),
                                                   (torch.float32, "virtual", 72), (torch.float32, "virtual", 512)])
def test_the_host_takes_sdpa_where_the_native_kernel_cannot_serve(dtype, kind, head_dim):
    assert pick("cpu", dtype, kind, head_dim).name == "sdpa"
    with pytest.raises(ValueError, match="attention kernel 'native' cannot serve.*head_dim a multiple of 16"):
        pick("cpu", dtype, kind, head_dim, "native")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_takes_flash_for_16_bit_virtual_caches_when_installed(dtype):
    kernel = pick("cuda", dtype, "virtual", 64, installed=EVERY)
    assert kernel.name == "flash" and kernel.stores_kv
    assert pick("cuda", dtype, "virtual", 64, installed=NO_FLASH).name == "triton"
    assert pick("cuda", dtype, "virtual", 64, installed=NEITHER).name == "sdpa"


def test_cuda_decodes_float32_virtual_caches_with_triton_and_paged_caches_with_sdpa():
    assert pick("cuda", torch.float32, "virtual", 64, installed=EVERY).name == "triton"
    assert pick("cuda", torch.float32, "virtual", 64, installed=NEITHER).name == "sdpa"
    assert pick("cuda", torch.bfloat16, "paged", 64, installed=EVERY).name == "sdpa"
    assert pick("cpu", torch.float32, "paged", 64).name == "sdpa"


def test_cuda_takes_flash_for_paged_caches_whose_blocks_flash_attn_takes():
    assert pick("cuda", torch.bfloat16, "paged", 64, block_size=256, installed=EVERY).name == "flash"
    assert pick("cuda", torch.bfloat16, "paged", 64, block_size=512, installed=EVERY).name == "flash"
    assert pick("cuda", torch.bfloat16, "paged", 64, block_size=16, installed=EVERY).name == "sdpa"
    assert pick("cuda", torch.bfloat16, "paged", 64, block_size=256, installed=NEITHER).name == "sdpa"
    with pytest.raises(ValueError, match="a paged cache of 16-token blocks.*blocks a multiple of 256 tokens"):
        pick("cuda", torch.bfloat16, "paged", 64, "flash", block_size=16, installed=EVERY)


def test_the_cache_says_what_the_registry_weighs():
    paged = make_cache("paged", block_size=16)
    assert registry.pick_for(paged) is pick("cpu", torch.float32, "paged", 8, block_size=16)
    assert registry.pick_for(make_cache(), "sdpa") is pick("cpu", torch.float32, "virtual", 8, "sdpa")


def test_a_kernel_chosen_by_name():
    assert pick("cuda", torch.bfloat16, "virtual", 64, "sdpa", installed=EVERY).name == "sdpa"
    assert pick("cuda", torch.bfloat16, "virtual", 64, "flash", installed=EVERY).name == "flash"


def test_an_unknown_name_is_refused_naming_the_kernels():
    with pytest.raises(ValueError, match="unknown attention kernel 'fast'.*'native', 'flash', 'triton', 'sdpa'"):
        pick("cpu", torch.float32, "virtual", 64, "fast")


@pytest.mark.parametrize("device_type, dtype, kind, installed, serving", [
    ("cpu", torch.float16, "virtual", EVERY, "'sdpa'"),
    ("cuda", torch.float32, "virtual", EVERY, "'triton', 'sdpa'"),
    ("cuda", torch.bfloat16, "paged", EVERY, "'sdpa'"),
    ("cuda", torch.bfloat16, "virtual", NEITHER, "'sdpa'"),
])
def test_flash_by_name_is_refused_where_it_cannot_serve(device_type, dtype, kind, installed, serving):
    with pytest.raises(ValueError, match=f"attention kernel 'flash' cannot serve.*the kernels that can: {serving}"):
        pick(device_type, dtype, kind, 64, "flash", installed=installed)


def test_a_kernel_whose_package_is_missing_is_refused_naming_it():
    with pytest.raises(ValueError, match="'triton' cannot serve.*triton is not installed"):
        pick("cuda", torch.bfloat16, "virtual", 64, "triton", installed=NEITHER)
    with pytest.raises(ValueError, match="'flash' cannot serve.*flash-attn is not installed"):
        pick("cuda", torch.bfloat16, "virtual", 64, "flash", installed=NEITHER)


def test_no_kernel_for_an_unknown_device():
    with pytest.raises(ValueError, match="no attention kernel serves mps.*the kernels that can: none"):
        pick("mps", torch.float32, "virtual", 64)


def test_the_table_lists_the_fastest_first():
    """The automatic choice is the first kernel that serves: the fastest first."""
    assert list(registry.KERNELS) == ["native", "flash", "triton", "sdpa"]


def test_the_hf_cache_records_its_kernel():
    from vattn.config import CacheConfig
    from vattn.integrations.hf import VAttnCache

    cache = VAttnCache(CacheConfig(2, 2, 64, torch.float32, max_num_seqs=2, max_seq_len=64, layout="per_head",
                                   page_size=16 << 10))
    assert cache.kernel is pick("cpu", torch.float32, "virtual", 64)
    assert cache.attn_implementation == "vattn_native"


def test_the_engine_takes_a_kernel_by_name():
    from tiny_models import tiny_model
    from vattn.engine import LLMEngine

    model = tiny_model("llama", "sdpa")
    assert LLMEngine(model, max_num_seqs=2, max_seq_len=64).runner.kernel.name == "native"
    engine = LLMEngine(model, max_num_seqs=2, max_seq_len=64, attention="sdpa")
    assert engine.runner.kernel.name == "sdpa"
    engine.close()
    with pytest.raises(ValueError, match="unknown attention kernel 'fastest'"):
        LLMEngine(model, max_num_seqs=2, max_seq_len=64, attention="fastest")


@pytest.mark.parametrize("head_dim, chosen", [(68, "triton"), (100, "triton"), (264, "sdpa")])
def test_flash_is_passed_over_for_a_head_dim_it_would_pad_and_the_choice_is_said(head_dim, chosen):
    registry.pick.cache_clear()
    with pytest.warns(UserWarning, match=f"'flash' does not take head_dim {head_dim}.*multiple of 8 up to 256.*"
                                         f"running '{chosen}'"):
        assert pick("cuda", torch.bfloat16, "virtual", head_dim, installed=EVERY).name == chosen
    with pytest.raises(ValueError, match=f"'flash' cannot serve.*head_dim {head_dim}.*multiple of 8 up to 256"):
        pick("cuda", torch.bfloat16, "virtual", head_dim, "flash", installed=EVERY)


@pytest.mark.parametrize("head_dim", [8, 64, 72, 256])
def test_flash_takes_head_dims_in_multiples_of_8_up_to_256(head_dim):
    assert pick("cuda", torch.float16, "virtual", head_dim, installed=EVERY).name == "flash"


def test_the_native_kernel_passed_over_for_its_head_dim_is_said_and_other_misses_are_not(recwarn):
    registry.pick.cache_clear()
    with pytest.warns(UserWarning, match="'native' does not take head_dim 72.*running 'sdpa'"):
        pick("cpu", torch.float32, "virtual", 72)
    recwarn.clear()
    assert pick("cpu", torch.float16, "virtual", 72).name == "sdpa"  # native does not take float16 at all
    assert pick("cuda", torch.bfloat16, "virtual", 72, installed=NEITHER).name == "sdpa"
    assert not [w for w in recwarn if "does not take head_dim" in str(w.message)]


def test_sdpa_on_cuda_is_pinned_to_backends_that_do_not_replan_per_shape():
    from vattn.attention import sdpa

    cuda = torch.backends.cuda
    before = cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()
    with sdpa.backends(torch.device("cuda", 0)):
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() and cuda.mem_efficient_sdp_enabled() and cuda.math_sdp_enabled()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before
    with sdpa.backends(torch.device("cpu")):
        assert cuda.cudnn_sdp_enabled() == before[0]  # the host's SDPA is left as torch has it
