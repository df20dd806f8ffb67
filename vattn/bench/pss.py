"""The peak memory of a process and everything it started, each page counted once.

A process's proportional set size (PSS, the `Pss:` line of
/proc/PID/smaps_rollup) charges a page shared by n processes 1/n to each, so
the PSS summed over a tree of processes counts every page once, where the sum
of their RSS counts a shared page once per process that maps it.  `PeakPss`
samples that sum every `INTERVAL` seconds on a thread of its own, finding the
tree afresh each time (processes started since are counted), and keeps its
peak; a process that exits between being listed and being read is skipped.
"""
import os
import threading

INTERVAL = 1.0  # seconds between samples


def tree(pid: int) -> list[int]:
    """`pid` and every process descended from it, by the parent ids in /proc/*/stat."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # the name may hold spaces and ')'
            except (OSError, IndexError, ValueError):  # gone since it was listed
                continue
            children.setdefault(parent, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        out.append(p := todo.pop())
        todo += children.get(p, [])
    return out


def pss_bytes(pid: int) -> int:
    """`pid`'s PSS in bytes; 0 once it has exited (a zombie included)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def tree_peak_rss_bytes(pid: int) -> int:
    """The RSS high-water marks (`VmHWM:` of /proc/PID/status) of `pid` and its descendants, summed: a page
    several of them map counts once for each."""
    return sum(_status_kib(p, "VmHWM") for p in tree(pid)) << 10


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_bytes(pid: int) -> int:
    """The PSS of `pid` and its descendants, summed."""
    return sum(pss_bytes(p) for p in tree(pid))


class PeakPss:
    """The peak of `tree_pss_bytes(pid)` between `start()` and `stop()`: a
    sample when started, one every `interval` seconds, and one when stopped.
    Also a context manager."""

    def __init__(self, pid: int, interval: float = INTERVAL):
        self.pid, self.interval, self.peak_bytes = pid, interval, 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pss-{pid}", daemon=True)

    def start(self) -> "PeakPss":
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stops sampling (again: does nothing) and returns the peak in bytes."""
        self._stopping.set()
        self._thread.join()
        return self.peak_bytes

    def _run(self) -> None:
        self._sample()
        while not self._stopping.wait(self.interval):
            self._sample()
        self._sample()

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, tree_pss_bytes(self.pid))

    def __enter__(self) -> "PeakPss":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
