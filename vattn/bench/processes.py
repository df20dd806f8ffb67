"""The benchmarks' child processes: how each is ended."""
import subprocess


def wait_or_kill(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Waits for `proc` (already asked to end) to exit; kills it if it has not after `timeout` seconds."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
