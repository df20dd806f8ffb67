"""The process's limit on mappings, shared by its host caches.

Linux gives a process `vm.max_map_count` mapping entries, and a host cache's
buffers take one per run of pages mapped and one per unmapped gap.  A cache
that took the last entry would leave the rest of the process (thread stacks,
the allocator's large blocks) none to map, and its own map and unmap calls,
which may split a mapping, none to finish.  So the caches draw entries from a
budget: the limit, less the entries the process held when the budget was
first drawn on, less a reserve for all the process maps later.  Past it a
draw raises `MapLimitError` before any call is made, which the caches meet as
they meet memory running short.
"""
import threading
from pathlib import Path

from vattn.binding import MapLimitError

RESERVE = 8  # 1/RESERVE of the limit is left to the rest of the process


class Budget:
    """The entries left to draw, process-wide."""

    def __init__(self, limit: int, held: int):
        self.limit, self.left = limit, limit - held - limit // RESERVE
        self._lock = threading.Lock()

    def draw(self, n: int) -> None:
        """Take `n` entries (give back `-n`); `MapLimitError`, nothing taken, past what is left."""
        with self._lock:
            if n > self.left:
                raise MapLimitError(f"mapping {n} more entries would leave the process too few of its "
                                    f"vm.max_map_count={self.limit} (raise it with sysctl, or use larger pages)")
            self.left -= n


class Hold:
    """One cache's entries from the budget, given back when it goes."""

    def __init__(self, budget: Budget | None):
        self.budget, self.held = budget, 0

    def draw(self, n: int) -> None:
        if self.budget is not None:
            self.budget.draw(n)
        self.held += n

    def __del__(self):
        if self.budget is not None and self.held:
            self.budget.draw(-self.held)


_budget: Budget | None = None
_made = threading.Lock()


def hold() -> Hold:
    """A new hold on the process's budget (one that counts without limit where the OS sets none)."""
    global _budget
    with _made:
        if _budget is None:
            try:
                limit = int(Path("/proc/sys/vm/max_map_count").read_text())
                held = Path("/proc/self/maps").read_text().count("\n")
            except OSError:  # not Linux: no limit to keep
                return Hold(None)
            _budget = Budget(limit, held)
    return Hold(_budget)
