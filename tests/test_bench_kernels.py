import json

import pytest
import torch
import torch.nn.functional as F

from vattn.bench import kernels


def test_run_covers_the_grid(tmp_path):
    path = tmp_path / "kernels.json"
    result = kernels.run(str(path), str(tmp_path / "plots"), batches=[1, 2], contexts=[64, 128], dtypes=["float32"],
                         repeats=2)
    rows = json.loads(path.read_text())["rows"]
    assert rows == result["rows"]
    assert all(set(r) == {"phase", "dtype", "model", "batch", "context", "layout", "ms"} and r["ms"] > 0 for r in rows)
    expected = {(phase, "float32", model, batch, context, layout)
                for phase, batches in (("decode", [1, 2]), ("prefill", [1]))
                for model in kernels.MODELS for batch in batches for context in (64, 128) for layout in kernels.LAYOUTS}
    got = [(r["phase"], r["dtype"], r["model"], r["batch"], r["context"], r["layout"]) for r in rows]
    assert sorted(got) == sorted(expected)
    assert result["targets"]["measured"] == {}  # batch 8, context 2048 is not in this grid
    charts = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert charts == {f"kernels_{phase}_float32_{model}_b{batch}.png" for model in kernels.MODELS
                      for phase, batch in (("decode", 1), ("decode", 2), ("prefill", 1))}


def test_grid_thins_bfloat16():
    points = kernels.grid([1, 8], [512, 2048], ["float32", "bfloat16"])
    assert ("decode", "float32", "Llama-3-8B", 8, 2048) in points
    assert ("decode", "bfloat16", "Llama-3-8B", 8, 2048) not in points
    assert ("prefill", "bfloat16", "Llama-3-8B", 1, 2048) not in points
    assert {p[3] for p in points if p[0] == "prefill"} == {1}


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("model", list(kernels.MODELS))
def test_layouts_compute_the_same_attention(phase, model):
    B, context = 3, 300  # not a whole number of pages or blocks; prefill: a 256-token chunk after 44 tokens
    H, Hkv, D = kernels.MODELS[model]
    with torch.inference_mode():
        caches = kernels.make_layouts(model, torch.float32, B, context)
        q = kernels.make_queries(phase, model, B, context, torch.float32)
        outs = {name: kernels.kernel(phase, cache, q, context)() for name, cache in caches.items()}
        K, V = (t.repeat_interleave(H // Hkv, dim=1) for t in (caches["contiguous"].k, caches["contiguous"].v))
        queries = q[:, :, None] if phase == "decode" else q.transpose(1, 2)  # [B, H, n, D]
        n = queries.shape[2]
        mask = torch.arange(context) <= torch.arange(context - n, context)[:, None]
        ref = F.scaled_dot_product_attention(queries, K, V, attn_mask=mask)
        ref = ref[:, :, 0] if phase == "decode" else ref.transpose(1, 2)
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"{name} {phase} {model}")
