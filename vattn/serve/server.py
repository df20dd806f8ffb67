"""`vattn serve`: the model loaded into an engine, the engine's loop on its
thread, the app on uvicorn.  SIGTERM (or Ctrl-C) stops accepting, lets the
requests in flight finish for up to `--shutdown-timeout` seconds, ends the
rest with an error, and exits 0."""
import argparse
import faulthandler
import logging
import signal
import threading

import uvicorn

from vattn import models
from vattn.llm import LLM
from vattn.serve.app import Server, make_app
from vattn.serve.loop import EngineLoop
from vattn.serve.metrics import ServerMetrics

log = logging.getLogger("vattn.serve")

# the flags that are EngineConfig fields, and their names there
SETTINGS = {"max_model_len": "max_seq_len", "max_num_seqs": "max_num_seqs",
            "max_num_batched_tokens": "max_num_batched_tokens", "kv_cache_memory_bytes": "memory_budget",
            "enable_prefix_caching": "enable_prefix_caching", "tensor_parallel_size": "tensor_parallel_size",
            "preemption_mode": "preemption_mode"}


# Seconds an idle connection is kept open: longer than clients keep theirs (aiohttp's 15 s), so the client
# closes it first; a server that closed first could reset a request the client had just sent on it.
KEEP_ALIVE = 75


def engine_settings(args: argparse.Namespace) -> dict:
    """The `EngineConfig` fields the flags set (the others keep their defaults)."""
    return {ours: getattr(args, flag) for flag, ours in SETTINGS.items() if getattr(args, flag) is not None}


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.enable()  # a fatal signal leaves every thread's stack in the log
    llm = LLM(args.model, dtype=args.dtype, **engine_settings(args))
    name = args.served_model_name or args.model or models.DEFAULT
    metrics = ServerMetrics(name)
    loop = EngineLoop(llm.engine, metrics.observe)
    server = Server(loop, llm.tokenizer, name, llm.engine.config.max_seq_len, metrics, args.api_key,
                    args.max_waiting_requests)
    config = uvicorn.Config(make_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=KEEP_ALIVE)
    log.info("serving %s on http://%s:%d", name, args.host, args.port)
    try:
        GracefulServer(config, loop, args.shutdown_timeout).run()
    finally:
        loop.close()
        llm.engine.close()
    return 0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which on the first SIGTERM or SIGINT also ends the
    requests still in flight `timeout` seconds later, so that it stops."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, timeout: float):
        super().__init__(config)
        self.loop, self.timeout, self._deadline = loop, timeout, None

    def handle_exit(self, sig, frame) -> None:
        if self._deadline is None:
            log.info("signal %d: no new requests; those in flight have %.0f s to finish", sig, self.timeout)
            self._deadline = threading.Timer(self.timeout, self.loop.fail_all, ["the server is shutting down"])
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        # uvicorn raises the signal it caught again once it has stopped: let that end nothing, so the exit is 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        super().run(sockets)
        if self._deadline is not None:
            self._deadline.cancel()
