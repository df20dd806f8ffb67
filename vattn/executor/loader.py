"""Loading the model a runner serves: the built-in SmolLM2, a transformers
checkpoint by name or directory, or the user's own loader; one rank's shard
of it under tensor parallelism."""


def load(model, size: int, with_tokenizer: bool = True):
    """(this rank's shard of the model, its tokenizer or None).  `model`: None
    (SmolLM2-135M-Instruct, float32), a transformers checkpoint's name or
    directory, or a loader: a picklable function taking `from_pretrained`'s
    keywords (`distributed_config`, for a shard) and giving back (model,
    tokenizer).  One rank (`size` 1) loads the whole model."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shard = {"distributed_config": DistributedConfig(tp_size=size)} if size > 1 else {}
    if callable(model):
        loaded, tokenizer = model(**shard)
    elif model is None:
        from vattn.models import ENGINE_DTYPE, load_smollm2

        loaded, tokenizer = load_smollm2(dtype=ENGINE_DTYPE, **shard)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto", **shard).eval()
        tokenizer = _tokenizer(model) if with_tokenizer else None
    if size > 1:
        check_shardable(loaded.config, size)
    return loaded, tokenizer


def check_shardable(config, size: int) -> None:
    """Refuse a model its tensor-parallel plan cannot split into `size` ranks."""
    c = config.get_text_config()
    if not getattr(c, "base_model_tp_plan", None):
        raise ValueError(f"tensor parallelism needs transformers' tensor-parallel plan, and {c.model_type} has "
                         f"none (covered: every architecture whose config has base_model_tp_plan, such as "
                         f"llama, qwen2, mistral)")
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    if kv_heads % size or heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {heads} attention heads and "
                         f"{kv_heads} KV heads (each rank holds its own)")


def _tokenizer(name):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):  # a checkpoint without one: prompts go as token ids
        return None
