"""The attention implementation `vattn bench hf --attn vattn_sdpa` runs."""
import torch
from tiny_models import tiny_model

import vattn.bench.hf  # noqa: F401  (registers "vattn_sdpa")
from vattn.integrations.hf import VAttnCache


def test_same_kernel_sdpa_changes_no_result():
    """vattn_sdpa only makes decode take the packed-GQA kernel; outputs stay those of sdpa."""
    model = tiny_model("qwen2", "sdpa")
    ids = torch.randint(2, 95, (1, 7), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def cache():
        return VAttnCache.from_model(model, 12, 64, layout="per_head", page_size=4096)

    def greedy(**kwargs):
        return model.generate(**inputs, do_sample=False, max_new_tokens=30, min_new_tokens=30, **kwargs)

    with torch.no_grad():
        kv = cache()
        model(**inputs, cache=kv)
        step = dict(input_ids=ids[:, -1:], cache=kv)
        expected = model(**step).logits
        kv.crop(-1)
        model.set_attn_implementation("vattn_sdpa")
        got = model(**step).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(greedy(cache=cache()), greedy())
