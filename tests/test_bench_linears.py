"""`vattn bench linears`: every GEMM of a forward timed by each system at each
row count, vLLM's through its peer script, whose output is checked."""
import json

import pytest
import torch
from test_bench_kernels import need_peer

from vattn.bench import linears, peers
import vattn.executor.gemm as gemm


def test_the_passes_are_the_served_models_gemms():
    layer, layers, head = linears.shapes()
    assert layer == [(960, 576), (576, 576), (3072, 576), (576, 1536)] and layers == 30 and head == (49152, 576)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_times_each_system_at_each_row_count(tmp_path, dtype):
    need_peer()
    path = tmp_path / "linears.json"
    result = linears.run(str(path), rows=[1, 9], repeats=1, dtype=str(dtype).removeprefix("torch."))
    names = {"onednn", "torch", "vllm"} | ({"vattn"} if gemm.serves(torch.ones(1, 1, dtype=dtype)) else set())
    esize = dtype.itemsize
    assert result["dtype"] == str(dtype).removeprefix("torch.") and result["weight_bytes"] == 134_479_872 * esize
    for rows in ("1", "9"):
        assert set(result["ms"][rows]) == names and all(ms > 0 for ms in result["ms"][rows].values())
        for name, gflops in result["gflops"][rows].items():
            assert gflops == pytest.approx(
                2 * int(rows) * result["weight_bytes"] / esize / result["ms"][rows][name] / 1e6)
    assert result["gemms"] == 30 * 4 + 1 and result["versions"]["vllm"]
    assert json.loads(path.read_text())["ms"] == result["ms"]


def test_vllm_off_f_linear_fails_loudly(monkeypatch):
    need_peer()
    monkeypatch.setattr(linears, "TOLERANCE", {torch.float32: 0.0})  # any rounding at all is then too much
    with pytest.raises(RuntimeError, match="off F.linear"):
        linears.vllm([2], repeats=1, gemms=[(96, 64)])


def test_run_without_the_peer_says_how_and_times_the_rest(monkeypatch, capsys):
    monkeypatch.setattr(peers, "vllm_python", lambda: None)
    result = linears.run(None, rows=[1], repeats=1)
    assert capsys.readouterr().out.count(peers.HOW) == 1
    assert "vllm" not in result["ms"]["1"] and result["ms"]["1"]["onednn"] > 0
    assert torch.get_num_threads() == result["threads"]
