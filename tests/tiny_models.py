"""Tiny random models of the architectures the cache and engine are checked on."""
import torch
import transformers
from packaging.version import Version
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=95, bos_token_id=1)
# generate()'s keyword for a cache object (`past_key_values` before transformers 5.24)
CACHE_KEYWORD = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
TINY = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),  # generations pass the window
}


def tiny_model(arch, attn, **config):
    """A tiny `arch` model of SMALL's shape (`config` overriding it), seeded, on attention `attn`."""
    config_cls, model_cls, extra = TINY[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL | extra | config)).eval()
    model.set_attn_implementation(attn)
    return model


def faulty_loader(path, fault, **shard):
    """A tensor-parallel loader (`vattn.executor.loader.load`) of the checkpoint
    at `path` whose rank 1 fails in its 6th layer call: `fault` "raise"
    raises there, "die" kills its process."""
    import os
    import signal

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **shard).eval()
    if dist.get_rank() == 1:
        calls = []

        def fail(module, args):
            calls.append(1)
            if len(calls) == 6:
                if fault == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected fault in rank 1's forward")

        model.model.layers[1].register_forward_pre_hook(fail)
    return model, None
