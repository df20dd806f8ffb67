"""The engines' step loop on a thread of its own, and the thread-safe way in
and out of it for the server's handlers.

Handlers (on the event loop) queue commands — add a request to a model's
engine, abort one, end them all, run a function — and wake the thread; the
thread runs the commands, then one step of each engine with an unfinished
request in turn (so no model starves while another has work), and hands each
request's outputs to the asyncio queue of the handler that added it.  Only
this thread touches the engines (and so the KV pool they may share), so the
event loop never waits for a step.
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


Observe = Callable[[str, LLMEngine, list[RequestOutput]], None]


class EngineLoop:
    def __init__(self, engines: dict[str, LLMEngine], observe: Observe | None = None):
        """`engines` by model name; `observe(name, engine, outputs)` is called
        on the thread after every step of an engine (the metrics)."""
        self.engines, self._observe = engines, observe
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._model: dict[str, str] = {}  # request id -> the model serving it
        self._stopped = False
        self._failed_steps = dict.fromkeys(engines, 0)
        self._thread = threading.Thread(target=self._run, name="vattn-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the handlers' side

    async def add(self, model: str, request_id: str, prompt: list[int], params: SamplingParams,
                  out: asyncio.Queue) -> None:
        """Queue a request to `model` whose outputs go to `out` (each a
        `RequestOutput`, or `Failed`).  The engine's refusal (`ValueError`)
        is raised here, with nothing queued."""
        done: Future = Future()
        self._send("add", model, request_id, prompt, params, (asyncio.get_running_loop(), out), done)
        await asyncio.wrap_future(done)

    async def call(self, fn: Callable[[], object]) -> object:
        """`fn()` run on the thread between steps (what touches the engines or their pool); its result or
        exception."""
        done: Future = Future()
        self._send("call", fn, done)
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """End a request now (its client went away); its pages go back."""
        self._send("abort", request_id)

    def fail_all(self, message: str) -> None:
        """End every request in flight with an error (`Failed(message)`)."""
        self._send("fail_all", message)

    def num_waiting(self, model: str) -> int:
        """Requests to `model` queued and not yet running, and commands not yet run (read from any thread: a
        snapshot)."""
        return len(self.engines[model].scheduler.waiting) + self._commands.qsize()

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and all(e.is_healthy for e in self.engines.values())

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
                for name, engine in self.engines.items():
                    self._observed(name, engine, [])  # an abort changes the figures without a step
            if self._stopped:
                break
            busy = [name for name, engine in self.engines.items() if engine.has_unfinished_requests()]
            if not busy:
                self._wake.wait()
                self._wake.clear()
                continue
            for name in busy:
                self._step(name)

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

    def _add(self, model, request_id, prompt, params, out, done: Future) -> None:
        try:
            self.engines[model].add_request(prompt, params, request_id)
        except Exception as e:
            done.set_exception(e)
            return
        self._queues[request_id], self._model[request_id] = out, model
        done.set_result(None)

    def _call(self, fn, done: Future) -> None:
        try:
            done.set_result(fn())
        except Exception as e:
            done.set_exception(e)

    def _abort(self, request_id) -> None:
        model = self._model.pop(request_id, None)
        if self._queues.pop(request_id, None) is not None and request_id in self.engines[model].requests:
            self.engines[model].abort(request_id)
            log.info("aborted %s of %s", request_id, model)

    def _fail_all(self, message, model: str | None = None) -> None:
        """End every request in flight (to `model`, where given) with an error."""
        ids = [i for i in self._queues if model is None or self._model[i] == model]
        self._deliver([(request_id, Failed(message)) for request_id in ids])
        for request_id in ids:
            self._abort(request_id)

    def _stop(self) -> None:
        self._stopped = True

    def _step(self, name: str) -> None:
        engine = self.engines[name]
        try:
            outputs = engine.step()
        except Exception as e:
            failed = self._failed_steps[name] = self._failed_steps[name] + 1
            log.error("%s: step failed (%d in a row): %s: %s", name, failed, type(e).__name__, e)
            if failed >= FAILED_STEPS:
                self._fail_all(f"the engine failed {failed} steps in a row: {type(e).__name__}: {e}", name)
            time.sleep(RETRY_SECONDS)
            return
        self._failed_steps[name] = 0
        self._observed(name, engine, outputs)  # first, so that a client that has its tokens finds them counted
        self._deliver([(output.request_id, output) for output in outputs])
        for output in outputs:
            if output.finished:
                self._queues.pop(output.request_id, None)
                self._model.pop(output.request_id, None)

    def _observed(self, name: str, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        if self._observe is not None:
            try:
                self._observe(name, engine, outputs)
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
