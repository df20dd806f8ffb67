"""The tensor-parallel group as rank 0 and every other rank see it: the
`Message` rank 0 broadcasts once a step, and the group's end, in bounded
time, when any rank fails (`RankFailed`)."""
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from vattn.executor.inputs import StepInputs

FAILED = "vattn/failed/{}"  # the store key a rank's error goes under
TIMEOUT = timedelta(days=1)  # a collective's limit: ranks wait for rank 0's next step as long as it idles
GRACE = 5.0  # seconds a rank is given to report its error, then to exit when told


class RankFailed(RuntimeError):
    """A tensor-parallel rank failed or died; the engine can serve no more."""


@dataclass(slots=True)
class Message:
    """Rank 0's word to the others, once a step."""

    ops: list[tuple]  # cache calls to replay, in order
    inputs: StepInputs | None = None  # the forward to run, if any
    query: str | None = None  # "books": check and send back the page books; "stop": exit


@dataclass
class Group:
    """This process's place among the ranks."""

    rank: int
    size: int
    processes: list = field(default_factory=list)  # the ranks this process started, if it did
    closed: bool = False
    threads: int | None = None  # torch's threads here before the ranks split the cores; given back at shutdown

    @property
    def store(self):
        return dist.distributed_c10d._get_default_store()

    def send(self, message: Message) -> None:
        dist.broadcast_object_list([message], src=0)

    def receive(self) -> Message:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list | None:
        """Every rank's `value` on rank 0 (None elsewhere)."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0)
        return out

    def report(self, error: BaseException) -> None:
        """Leave this rank's error where rank 0 looks when a collective fails."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        try:
            self.store.set(FAILED.format(self.rank), text)
        except Exception:  # the store went with rank 0: nobody is left to tell
            pass

    def failure(self, error: BaseException) -> RankFailed:
        """What rank 0 raises when a collective or forward failed, once it has
        shut the other ranks down: each other rank's reported error or exit
        status (waiting up to `GRACE` seconds for one to show), else `error`
        itself."""
        deadline = time.monotonic() + GRACE
        while True:
            reports = self.reports()
            if reports or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        why = "; ".join(f"rank {r}: {text}" for r, text in sorted(reports.items()))
        self.shutdown()
        return RankFailed(f"tensor-parallel rank failed ({why or f'rank 0: {type(error).__name__}: {error}'}); "
                          f"the other ranks are shut down")

    def reports(self) -> dict[int, str]:
        """Each other rank's error as it reported it, or the status it exited with."""
        reports = {}
        for r in range(1, self.size):
            key = FAILED.format(r)
            try:
                if self.store.check([key]):
                    reports[r] = self.store.get(key).decode()
            except Exception:
                pass
        for r, p in enumerate(self.processes, start=1):
            if r not in reports and p.exitcode is not None and p.exitcode != 0:
                reports[r] = f"exited with status {p.exitcode}"
        return reports

    def shutdown(self) -> None:
        """Rank 0: make sure no rank it started outlives it, within bounded time."""
        if self.closed:
            return
        self.closed = True
        for p in self.processes:
            p.join(GRACE)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(GRACE)
            if p.is_alive():
                p.kill()
                p.join(GRACE)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone
                pass
        if self.threads is not None:
            torch.set_num_threads(self.threads)


def backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
