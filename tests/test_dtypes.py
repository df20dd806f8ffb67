"""The dtype setting (`vattn.dtypes`): what "auto" and each explicit dtype
serve on this CPU and on a GPU, the settings refused, a loaded model in
another dtype refused, the built-in SmolLM2 loaded as asked, and an old
conversion of it made again."""
import json

import pytest
import torch
from tiny_models import tiny_model

from vattn import LLM, dtypes, models
from vattn.engine import EngineConfig, LLMEngine

BF16_CPU = bool(dtypes.cpu_bf16())


@pytest.mark.parametrize("setting, declared, device, served", [
    ("auto", torch.bfloat16, "cpu", torch.bfloat16 if BF16_CPU else torch.float32),
    ("auto", torch.float16, "cpu", torch.bfloat16 if BF16_CPU else torch.float32),
    ("auto", torch.float32, "cpu", torch.float32),
    ("auto", None, "cpu", torch.float32),
    ("auto", torch.bfloat16, "cuda", torch.bfloat16),
    ("auto", torch.float16, "cuda", torch.float16),
    ("bfloat16", torch.float32, "cpu", torch.bfloat16),  # asked for: served, whatever the CPU
    ("float16", torch.float32, "cpu", torch.bfloat16),
    ("half", torch.float32, "cuda", torch.float16),
    ("float32", torch.bfloat16, "cpu", torch.float32),
    (torch.bfloat16, torch.float32, "cpu", torch.bfloat16),
])
def test_what_each_setting_serves(setting, declared, device, served):
    assert dtypes.choose(setting, declared, device)[0] == served


def test_auto_says_why_it_serves_float32_where_the_cpu_lacks_bfloat16_instructions(caplog):
    dtype, why = dtypes.choose("auto", torch.bfloat16)
    if BF16_CPU:
        assert dtype == torch.bfloat16 and why == "the checkpoint's declared bfloat16"
    else:
        assert "neither avx512_bf16 nor amx_bf16" in why
        with caplog.at_level("WARNING", logger="vattn"):
            assert dtypes.serve("auto", torch.bfloat16) == torch.float32
        assert "served as float32" in caplog.text


@pytest.mark.parametrize("setting", ["int8", "fp8", torch.int8, None, ["float32"]])
def test_an_unknown_dtype_is_refused(setting):
    with pytest.raises(ValueError, match="EngineConfig.dtype"):
        EngineConfig(dtype=setting)


def test_a_loaded_model_in_another_dtype_is_refused():
    model = tiny_model("llama", "sdpa")  # float32
    with pytest.raises(ValueError, match="the model is float32, and dtype='bfloat16' serves bfloat16"):
        LLMEngine(model, dtype="bfloat16")
    LLMEngine(model, dtype="float32", page_size=4096, max_num_seqs=2).close()
    LLMEngine(model, dtype="auto", page_size=4096, max_num_seqs=2).close()


@pytest.mark.parametrize("setting, served", [("bfloat16", torch.bfloat16), ("float32", torch.float32),
                                             ("auto", torch.bfloat16 if BF16_CPU else torch.float32)])
def test_the_built_in_smollm2_loads_in_the_dtype_served(setting, served):
    llm = LLM(dtype=setting, max_num_seqs=2, max_seq_len=64)
    try:
        assert llm.engine.model.dtype == served
        assert all(p.dtype == served for p in llm.engine.model.parameters())
        assert llm.engine.kv.cache.config.dtype == served
    finally:
        llm.engine.close()


def test_the_conversion_declares_bfloat16_and_an_old_one_is_made_again(tmp_path, monkeypatch):
    saved = models.model_dir()
    config = json.loads((saved / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["vattn_conversion"] == models.CONVERSION
    monkeypatch.setenv("VATTN_CACHE_DIR", str(tmp_path))
    old = tmp_path / saved.name
    old.mkdir()
    (old / "config.json").write_text(json.dumps(config | {"vattn_conversion": models.CONVERSION - 1}))
    remade = models.model_dir()
    assert remade == old
    assert json.loads((remade / "config.json").read_text())["vattn_conversion"] == models.CONVERSION
    assert (remade / "model.safetensors").exists()


def test_an_unknown_built_in_model_is_refused():
    with pytest.raises(ValueError, match="no built-in model 'llama-70b'"):
        models.model_dir("llama-70b")
