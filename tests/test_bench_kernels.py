import json
import math

import pytest
import torch
import torch.nn.functional as F

from vattn.bench import kernels, peers
from vattn.dtypes import cpu_bf16

ROW = {"phase", "dtype", "model", "batch", "context", "lengths", "layout", "ms", "floor_ms"}


def need_peer():
    """These tests run vLLM's kernel: CI makes its environment (`make peers`)."""
    if peers.vllm_python() is None:
        pytest.fail(peers.HOW)


def test_run_covers_the_grid(tmp_path):
    need_peer()
    path = tmp_path / "kernels.json"
    result = kernels.run(str(path), str(tmp_path / "plots"), batches=[1, 2], contexts=[64, 128], dtypes=["float32"],
                         repeats=2)
    recorded = json.loads(path.read_text())
    assert recorded.pop("commit") and recorded.pop("cpu") and recorded.pop("cpu_bf16") == list(cpu_bf16())
    assert recorded == result
    rows = result["rows"]
    for r in rows:
        assert set(r) == (ROW | {"block_size", "max_abs_err"} if r["layout"] == "vllm_paged" else ROW)
        assert r["ms"] > 0 and r["floor_ms"] > 0
    cases = [("decode", "uniform", [1, 2]), ("decode", "mixed", [2]), ("prefill", "uniform", [1])]
    columns = [(name, None) for name in kernels.LAYOUTS] + [("vllm_paged", b) for b in kernels.BLOCK_SIZES]
    expected = {(phase, "float32", model, batch, context, lengths, name, block)
                for phase, lengths, batches in cases for model in kernels.MODELS for batch in batches
                for context in (64, 128) for name, block in columns}
    got = [(*(r[k] for k in kernels.KEY), r["layout"], r.get("block_size")) for r in rows]
    assert sorted(got, key=str) == sorted(expected, key=str)
    assert all(r["max_abs_err"] <= kernels.TOLERANCE["float32"] for r in rows if r["layout"] == "vllm_paged")
    assert result["read_gb_per_s"] > 0 and result["threads"] == {"vattn": torch.get_num_threads(),
                                                                  "vllm_paged": torch.get_num_threads()}
    assert result["vllm"]["vllm"] and result["vllm"]["torch"] and result["torch"] == torch.__version__
    assert set(result["vllm"]["isa"]) == {str(b) for b in kernels.BLOCK_SIZES}
    assert result["targets"]["measured"] == {}  # batch 8, context 2048 is not in this grid
    charts = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert charts == {f"kernels_{phase}_float32_{model}_b{batch}{'_mixed' if lengths == 'mixed' else ''}.png"
                      for model in kernels.MODELS for phase, lengths, batches in cases for batch in batches}


def test_run_without_the_peer_says_how_and_runs_the_rest(monkeypatch, capsys):
    monkeypatch.setattr(peers, "vllm_python", lambda: None)
    result = kernels.run(None, None, batches=[2], contexts=[64], dtypes=["float32"], repeats=1)
    assert capsys.readouterr().out.count(peers.HOW) == 1
    assert result["vllm"] is None and result["threads"] == {"vattn": torch.get_num_threads()}
    assert {r["layout"] for r in result["rows"]} == set(kernels.LAYOUTS)


def test_grid_thins_bfloat16_and_mixes_lengths_at_the_largest_batch():
    points = kernels.grid([1, 8], [512, 2048], ["float32", "bfloat16"])
    assert ("decode", "float32", "Llama-3-8B", 8, 2048, "uniform") in points
    assert ("decode", "bfloat16", "Llama-3-8B", 8, 2048, "uniform") not in points
    assert ("prefill", "bfloat16", "Llama-3-8B", 1, 2048, "uniform") not in points
    assert {p[3] for p in points if p[0] == "prefill"} == {1}
    mixed = [p for p in points if p[5] == "mixed"]
    assert {(p[0], p[3]) for p in mixed} == {("decode", 8)}
    assert ("decode", "bfloat16", "Llama-3-8B", 8, 2048, "mixed") not in mixed
    lengths = kernels.request_lengths("mixed", 32, 2048)
    assert lengths == kernels.request_lengths("mixed", 32, 2048)  # seeded
    assert min(lengths) >= 64 and max(lengths) <= 2048 and len(set(lengths)) > 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA of one request's last queries `[n, H, D]` over its K/V `[H_kv, L, D]`."""
    n, L = q.shape[0], k.shape[1]
    mask = torch.arange(L) <= torch.arange(L - n, L)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("phase,kind", [("decode", "uniform"), ("decode", "mixed"), ("prefill", "uniform")])
@pytest.mark.parametrize("model", list(kernels.MODELS))
def test_layouts_compute_the_same_attention(phase, kind, model):
    B, context = 4, 300  # not a whole number of pages or blocks; prefill: a 256-token chunk after 44 tokens
    lengths = kernels.request_lengths(kind, B, context)
    assert kind == "uniform" or len(set(lengths)) == B
    with torch.inference_mode():
        caches = kernels.make_layouts(model, torch.float32, lengths)
        assert list(caches) == list(kernels.LAYOUTS)
        q = kernels.make_queries(phase, model, B, context, torch.float32)
        outs = {name: kernels.kernel(phase, cache, q, lengths, name)() for name, cache in caches.items()}
        K, V = caches["contiguous"].k, caches["contiguous"].v
        queries = q[:, None] if phase == "decode" else q
        ref = torch.stack([reference(queries[i], K[i, :, :n], V[i, :, :n]) for i, n in enumerate(lengths)])
        ref = ref[:, 0] if phase == "decode" else ref
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"{name} {phase} {kind} {model}")


def test_vllm_paged_agrees_with_the_reference():
    need_peer()
    points = [kernels.Point(phase, dtype, model, batch, 300, kind)
              for model in kernels.MODELS for dtype in ("float32", "bfloat16")
              for phase, batch, kind in (("decode", 3, "uniform"), ("decode", 4, "mixed"), ("prefill", 2, "uniform"))]
    result = kernels.vllm_paged(points, repeats=1)  # raises where an output is off the reference
    assert len(result["results"]) == len(points)
    for point, measured in zip(points, result["results"]):
        assert [m["block_size"] for m in measured] == list(kernels.BLOCK_SIZES)
        for m in measured:
            assert m["ms"] > 0 and 0 < m["max_abs_err"] <= kernels.TOLERANCE[point[1]], (point, m)


@pytest.mark.parametrize("error", [1.0, math.nan])
def test_vllm_paged_off_the_reference_fails_loudly(error):
    point = kernels.Point("decode", "float32", "Llama-3-8B", 8, 2048, "uniform")
    with pytest.raises(AssertionError, match="vllm_paged block 128 .* max_abs_err"):
        kernels.check(point, [{"block_size": 16, "ms": 1.0, "max_abs_err": 0.0},
                              {"block_size": 128, "ms": 1.0, "max_abs_err": error}])
