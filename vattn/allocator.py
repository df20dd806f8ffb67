"""The memory allocator vattn's processes run with: tcmalloc where it is
installed (Debian's libtcmalloc-minimal4), preloaded as vLLM's CPU docs
advise for vLLM's.  oneDNN's linears allocate their output afresh at every
call, and glibc's malloc hands large blocks back to the OS and faults them
in again: with tcmalloc a bfloat16 decode step of SmolLM2 at 48 requests
takes about an eighth less time.  `VATTN_TCMALLOC=0` keeps glibc's."""
import os
import sys
from pathlib import Path

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def wanted() -> bool:
    return TCMALLOC.exists() and os.environ.get("VATTN_TCMALLOC", "1") != "0"


def loaded() -> bool:
    """Whether this process runs tcmalloc."""
    with open("/proc/self/maps") as f:
        return any("libtcmalloc" in line for line in f)


def preloaded(env: dict[str, str]) -> dict[str, str]:
    """`env` with tcmalloc first in LD_PRELOAD, where `wanted`."""
    paths = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if not wanted() or str(TCMALLOC) in paths:
        return dict(env)
    return dict(env) | {"LD_PRELOAD": ":".join([str(TCMALLOC), *paths])}


def run_with_tcmalloc() -> None:
    """Start this command again under tcmalloc, where `wanted` and not yet
    running (a library preloaded after start would not serve the blocks
    malloc already handed out)."""
    if wanted() and not loaded():
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], preloaded(dict(os.environ)))


def name() -> str:
    """The allocator this process runs, for `vattn info`."""
    if loaded():
        return f"tcmalloc ({TCMALLOC})"
    if not TCMALLOC.exists():
        return f"glibc malloc (no {TCMALLOC}: apt install libtcmalloc-minimal4)"
    return "glibc malloc (VATTN_TCMALLOC=0)" if not wanted() else f"glibc malloc (not preloaded: LD_PRELOAD={TCMALLOC})"
