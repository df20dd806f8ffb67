"""Loading the model a runner serves: a built-in model (`vattn.models`), a
transformers checkpoint by name or directory, or the user's own loader; one
rank's shard of it under tensor parallelism."""


def load(model, size: int, dtype="auto"):
    """(this rank's shard of the model, its tokenizer or None).  `model`: None
    (the default built-in model), a built-in model's name, a transformers
    checkpoint's name or directory, or a loader: a picklable function taking
    `from_pretrained`'s keywords (`distributed_config`, for a shard; `dtype`
    where `dtype` is not "auto") and giving back (model, tokenizer).  One rank
    (`size` 1) loads the whole model, in the dtype `dtype` serves
    (`vattn.dtypes`)."""
    from transformers.distributed import DistributedConfig

    from vattn import dtypes
    from vattn.models import load_model

    shard = {"distributed_config": DistributedConfig(tp_size=size)} if size > 1 else {}
    if callable(model):
        dtypes.check(dtype)
        loaded, tokenizer = model(**shard, **({} if dtype == "auto" else {"dtype": dtypes.serve(dtype, None)}))
    else:
        loaded, tokenizer = load_model(model, dtype, **shard)
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
