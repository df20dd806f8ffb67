"""vattn's commands run under tcmalloc where it is installed (`vattn.allocator`), and on glibc's malloc when
told not to: checked in the real command's process, which starts itself again with the library preloaded."""
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
