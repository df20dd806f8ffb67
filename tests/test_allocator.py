"""vattn's commands run under tcmalloc where it is installed (`vattn.allocator`), and on glibc's malloc when
told not to: checked in the real command's process, which starts itself again with the library preloaded.
Under either, memory the engine lets go goes back to the OS."""
import json
import os
import subprocess
import sys

from vattn import allocator


def allocator_of_info(**env) -> str:
    out = subprocess.run([sys.executable, "-m", "vattn", "info"], env=os.environ | {"COLUMNS": "250"} | env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    return next(line for line in out.splitlines() if "memory allocator" in line)


def test_the_command_runs_under_tcmalloc_where_installed_and_glibc_s_malloc_when_told():
    assert ("tcmalloc (" in allocator_of_info()) == allocator.TCMALLOC.exists()
    assert "glibc malloc" in allocator_of_info(VATTN_TCMALLOC="0")


def test_preloaded_puts_tcmalloc_first_once_and_keeps_what_was_there(monkeypatch):
    monkeypatch.delenv("VATTN_TCMALLOC", raising=False)
    env = allocator.preloaded({"LD_PRELOAD": "/lib/other.so", "PATH": "/bin"})
    if allocator.TCMALLOC.exists():
        assert env["LD_PRELOAD"] == f"{allocator.TCMALLOC}:/lib/other.so"
        assert allocator.preloaded(env) == env  # not twice
    else:
        assert env["LD_PRELOAD"] == "/lib/other.so"
    assert env["PATH"] == "/bin"
    monkeypatch.setenv("VATTN_TCMALLOC", "0")
    assert allocator.preloaded({"PATH": "/bin"}) == {"PATH": "/bin"}


SECOND_ENGINE = """
import json, os
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from vattn.backends.host import trim_heap
from vattn.bench.pss import pss_bytes
from vattn.engine import LLMEngine
config = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
                     num_key_value_heads=4, vocab_size=1000)
model = LlamaForCausalLM(config).eval()  # 116 MiB of linear weights
LLMEngine(model, memory_budget=16 << 20).close()  # packs the weights, then gives them back unpacked
first = pss_bytes(os.getpid())
engine = LLMEngine(model, memory_budget=16 << 20)  # packs them again, letting the unpacked ones go
grew = pss_bytes(os.getpid()) - first  # measured before the call below trims the heap itself
print(json.dumps({"grew": grew, "tcmalloc": trim_heap()}))
"""


def test_a_second_engine_over_a_model_does_not_hold_its_weights_twice():
    """An allocator keeps large frees resident for later allocations: the unpacked weights a second engine
    lets go stay unless `trim_heap` gives them back, as packing does (without it the second engine grew the
    process's PSS by 126 MiB under either allocator)."""
    glibc = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for env in (allocator.preloaded(glibc), glibc):
        out = subprocess.run([sys.executable, "-c", SECOND_ENGINE], env=env, capture_output=True, text=True,
                             timeout=300, check=True).stdout
        got = json.loads(out.splitlines()[-1])
        assert got["tcmalloc"] == (str(allocator.TCMALLOC) in env.get("LD_PRELOAD", ""))
        assert got["grew"] < 16 << 20
