"""The engine's step loop on a thread of its own, and the thread-safe way in
and out of it for the server's handlers.

Handlers (on the event loop) queue commands — add a request, abort one, end
them all — and wake the thread; the thread runs the commands, then a step
whenever a request is unfinished, and hands each request's outputs to the
asyncio queue of the handler that added it.  Only this thread touches the
engine, so the event loop never waits for a step.
"""
import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from vattn.engine.llm_engine import LLMEngine
from vattn.engine.request import RequestOutput
from vattn.sampling_params import SamplingParams

log = logging.getLogger("vattn.serve")

FAILED_STEPS = 3  # failing steps in a row that end every request in flight
RETRY_SECONDS = 0.05


class Failed(str):
    """What a request's queue gets when the server ends it with an error (the message)."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, observe: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        """`observe(engine, outputs)` is called on the thread after every step
        (the metrics)."""
        self.engine, self._observe = engine, observe
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._failed_steps = 0
        self._thread = threading.Thread(target=self._run, name="vattn-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the handlers' side

    async def add(self, request_id: str, prompt: list[int], params: SamplingParams, out: asyncio.Queue) -> None:
        """Queue a request whose outputs go to `out` (each a `RequestOutput`,
        or `Failed`).  The engine's refusal (`ValueError`) is raised here,
        with nothing queued."""
        done: Future = Future()
        self._send("add", request_id, prompt, params, (asyncio.get_running_loop(), out), done)
        await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """End a request now (its client went away); its pages go back."""
        self._send("abort", request_id)

    def fail_all(self, message: str) -> None:
        """End every request in flight with an error (`Failed(message)`)."""
        self._send("fail_all", message)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (read from any thread: a snapshot)."""
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.engine.is_healthy

    def close(self) -> None:
        """Stop the thread (requests still in flight are ended with an error)."""
        self.fail_all("the server is shutting down")
        self._send("stop")
        self._thread.join()

    def _send(self, *command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stopped:
            if self._drain():
                self._observed([])  # an abort changes the figures without a step
            if self._stopped:
                break
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            self._step()

    def _drain(self) -> int:
        """Run the queued commands; how many there were."""
        done = 0
        while True:
            try:
                command, *args = self._commands.get_nowait()
            except queue.Empty:
                return done
            done += 1
            try:
                getattr(self, f"_{command}")(*args)
            except Exception:  # nothing a command does may stop the loop
                log.exception("%s failed", command)

    def _add(self, request_id, prompt, params, out, done: Future) -> None:
        try:
            self.engine.add_request(prompt, params, request_id)
        except Exception as e:
            done.set_exception(e)
            return
        self._queues[request_id] = out
        done.set_result(None)

    def _abort(self, request_id) -> None:
        if self._queues.pop(request_id, None) is not None and request_id in self.engine.requests:
            self.engine.abort(request_id)
            log.info("aborted %s", request_id)

    def _fail_all(self, message) -> None:
        self._deliver([(request_id, Failed(message)) for request_id in self._queues])
        for request_id in list(self._queues):
            self._abort(request_id)

    def _stop(self) -> None:
        self._stopped = True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._failed_steps += 1
            log.error("step failed (%d in a row): %s: %s", self._failed_steps, type(e).__name__, e)
            if self._failed_steps >= FAILED_STEPS:
                self._fail_all(f"the engine failed {self._failed_steps} steps in a row: {type(e).__name__}: {e}")
            time.sleep(RETRY_SECONDS)
            return
        self._failed_steps = 0
        self._observed(outputs)  # first, so that a client that has its tokens finds them counted
        self._deliver([(output.request_id, output) for output in outputs])
        for output in outputs:
            if output.finished:
                self._queues.pop(output.request_id, None)

    def _observed(self, outputs: list[RequestOutput]) -> None:
        if self._observe is not None:
            try:
                self._observe(self.engine, outputs)
            except Exception:
                log.exception("observing the step failed")

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Put each (request id, item) in its request's queue, with one call into each event loop."""
        puts: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            if (target := self._queues.get(request_id)) is not None:
                loop, out = target
                puts.setdefault(loop, []).append((out, item))
        for loop, these in puts.items():
            try:
                loop.call_soon_threadsafe(_put_all, these)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for out, item in puts:
        out.put_nowait(item)
