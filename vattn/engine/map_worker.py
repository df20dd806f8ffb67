"""Maps the pages the next step will need while the current step computes
(vAttention's eager allocation).  One job at a time; the engine waits for it
before it changes any slot (finishing, preempting, admitting, aborting), so a
job only touches slots that are still running and no page is mapped for a
request that is gone."""
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class MapWorker:
    def __init__(self):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vattn-map")
        self._job: Future | None = None
        self.busy_seconds = 0.0  # spent mapping in the background

    def submit(self, job: Callable[[], object]) -> None:
        assert self._job is None, "wait for the previous job first"
        self._job = self._thread.submit(self._timed, job)

    def wait(self) -> float:
        """Wait for the job (re-raising its error); returns the seconds waited."""
        if self._job is None:
            return 0.0
        start = time.perf_counter()
        job, self._job = self._job, None
        job.result()
        return time.perf_counter() - start

    def close(self) -> None:
        if self._job is not None:
            self._job.exception()  # let it finish; its error no longer matters
            self._job = None
        self._thread.shutdown()

    def _timed(self, job: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            job()
        finally:
            self.busy_seconds += time.perf_counter() - start
