"""`vattn serve`: each model loaded into an engine (several share one KV
pool), the engines' loop on its thread, the app on uvicorn.  SIGTERM (or
Ctrl-C) stops accepting, lets the requests in flight finish for up to
`--shutdown-timeout` seconds, ends the rest with an error, and exits 0."""
import argparse
import faulthandler
import logging
import signal
import threading

import uvicorn

from vattn import models
from vattn.kv.shared import KVPool
from vattn.llm import LLM
from vattn.serve.app import Model, Server, make_app
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


def served_models(args: argparse.Namespace) -> dict[str, str | None]:
    """The models to serve: the names requests use, and what each loads."""
    if not args.models:
        return {args.served_model_name or args.model or models.DEFAULT: args.model}
    if args.model is not None or args.served_model_name:
        raise SystemExit("vattn serve: give one model (MODEL, --served-model-name) or several (--model NAME=MODEL), "
                         "not both")
    served = dict(args.models)
    if len(served) < len(args.models):
        raise SystemExit("vattn serve: two --model flags give the same name")
    return served


def make_pool(args: argparse.Namespace, names: list[str]) -> KVPool | None:
    """The KV pool several models share (None for one model with no floor or cap)."""
    for flag, limits in (("--kv-floor", args.kv_floor), ("--kv-cap", args.kv_cap)):
        for name, _ in limits:
            if name not in names:
                raise SystemExit(f"vattn serve: {flag} names {name!r}, which is not served (served: {names})")
    if len(names) == 1 and not args.kv_floor and not args.kv_cap:
        return None
    if args.kv_cache_memory_bytes is None:
        raise SystemExit("vattn serve: models sharing a KV pool need its size: --kv-cache-memory-bytes")
    if args.tensor_parallel_size > 1:
        raise SystemExit("vattn serve: a shared KV pool serves models of one rank (--tensor-parallel-size 1)")
    floors, caps = dict(args.kv_floor), dict(args.kv_cap)
    try:
        pool = KVPool(args.kv_cache_memory_bytes)
        for name in names:
            pool.add(name, floors.get(name, 0), caps.get(name))
    except ValueError as e:
        raise SystemExit(f"vattn serve: {e}") from None
    return pool


def main(args: argparse.Namespace) -> int:
    served = served_models(args)
    pool = make_pool(args, list(served))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.enable()  # a fatal signal leaves every thread's stack in the log
    settings = engine_settings(args)
    if pool is not None:
        del settings["memory_budget"]
    llms = {}
    for name, model in served.items():
        try:
            llms[name] = LLM(model, dtype=args.dtype, **settings,
                             **({} if pool is None else {"kv_pool": pool.member(name)}))
        except ValueError as e:
            raise SystemExit(f"vattn serve: {name}: {e}") from None
    metrics = ServerMetrics(list(llms), pool)
    loop = EngineLoop({name: llm.engine for name, llm in llms.items()}, metrics.observe)
    server = Server(loop, {name: Model(llm.tokenizer, llm.engine.config.max_seq_len) for name, llm in llms.items()},
                    metrics, args.api_key, args.max_waiting_requests, pool)
    config = uvicorn.Config(make_app(server), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=KEEP_ALIVE)
    if pool is not None:
        log.info("one KV pool of %d bytes (%d chunks): %s", pool.memory_budget, pool.num_chunks,
                 ", ".join(f"{n} floor {s.floor} cap {s.cap}" for n, s in pool.split().items()))
    log.info("serving %s on http://%s:%d", ", ".join(llms), args.host, args.port)
    try:
        GracefulServer(config, loop, args.shutdown_timeout).run()
    finally:
        loop.close()
        for llm in llms.values():
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
