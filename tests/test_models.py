"""The built-in shapes (`vattn.models.SHAPES`): made with the shapes they
name, in bfloat16 with tied embeddings, and served by vattn and by vLLM from
the same directory with the same first tokens."""
import json
from pathlib import Path

import pytest

from vattn import models
from vattn.bench import e2e, peers

pytestmark = pytest.mark.slow

WIDTHS = {"llama-3.2-1b-shape": (16, 2048, 32, 8, 8192), "qwen2.5-0.5b-shape": (24, 896, 14, 2, 4864)}


@pytest.mark.parametrize("name", list(models.SHAPES))
def test_a_shape_loads_in_both_systems_with_the_same_first_tokens(name, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    where = models.model_dir(name)
    config = json.loads((where / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == WIDTHS[name]
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152 and config["dtype"] == "bfloat16"
    with safe_open(where / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert {str(f.get_slice(k).get_dtype()) for k in names} == {"BF16"}
    assert "lm_head.weight" not in names
    assert ("self_attn.q_proj.bias" in " ".join(names)) == (name.startswith("qwen"))
    tokenizer = AutoTokenizer.from_pretrained(where)
    reqs = [{"prompt": r["prompt"], "max_tokens": 2} for r in e2e.requests(tokenizer, "sharegpt", num_prompts=4,
                                                                            max_tokens=2)]
    if peers.vllm_python() is None:
        pytest.fail(peers.HOW)
    budget = 1 << 30
    first = {}
    for system, options in (("vattn", {"memory_budget": budget}),
                            ("vllm_cpu", {"max_model_len": 2048, "kv_budget_bytes": budget, "enforce_eager": True})):
        worker = e2e.Worker(system, options, tmp_path / f"{system}.log", str(where), "float32")
        try:
            result = worker.serve(reqs, [0.0] * len(reqs))
        finally:
            worker.close()
        first[system] = [r["token_ids"] for r in result["requests"]]
    print(f"{name}: vattn {first['vattn']}, vLLM {first['vllm_cpu']}")
    assert first["vattn"] == first["vllm_cpu"]
    assert all(len(t) == 2 for t in first["vattn"])
