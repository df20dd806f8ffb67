"""`vattn bench serve`: `vattn serve` against `vllm serve`, both driven over
HTTP by vLLM's own load generator, `vllm bench serve` (the peer environment's:
`peers.py`, script `vllm_bench_serve.py`), and `vattn serve` against the
engine it serves, in process.

The servers start one after the other, each in the same settings: the model
(a built-in one) in one dtype, both cores, the same KV memory in bytes
(`e2e.default_budget`) and context length, every other setting at its
default (vLLM's: torch.compile, prefix caching; vattn's likewise).  The load
generator sends ShareGPT requests (`dataset`) to `/v1/completions`, streamed,
greedy, EOS ignored, at `--request-rate inf` and then at two Poisson rates
drawn from vLLM's saturated request throughput R (vattn's where vLLM is not
run): `BUSY` × R, about the most either server would be offered, and `CALM`
× R, where vLLM's median TTFT is well under a second.  Each round (of a rate,
a memory round and a warm-up) sends requests no other round sends, so no
round meets a prefix cached by another.  Each figure is the median of
`rounds` rounds; every figure `vllm bench serve` reports is kept.  The
servers take the timed rounds in turns (each round's requests go to every
server, one after another, before the next round's), so a drift in the
machine's speed over the run (as much as 20% within an hour on a 2-core
virtual machine) meets every server alike.

Memory: the peak PSS of a server and every process it started, summed
(`pss.PeakPss`), from its start through its memory round (the first chunk of
requests, all at once, not timed, while any other server idles); the timed
rounds run unobserved.

The in-process engine (`e2e.Worker`, system `vattn`) serves the requests of
the saturated rounds as `vllm bench serve` reads them from the file (prompt
ids, answer lengths), all at once, after a warm-up on the memory round's,
each in the turn of the servers' round of the same requests.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vattn import allocator
from vattn.bench import e2e, peers
from vattn.bench.load_generator import LoadGenerator
from vattn.bench.processes import wait_or_kill
from vattn.bench.pss import PeakPss, tree_peak_rss_bytes
from vattn.bench.report import median_figures
from vattn.report import console, machine, print_table, write_json
from vattn.serve.server import KEEP_ALIVE

SYSTEMS = ("vllm", "vattn")  # in the order they start and take turns: vLLM's saturated rate sets the Poisson rates
LOADS = ("saturated", "busy", "calm")  # the rates: inf, then two Poisson rates
BUSY, CALM = 0.8, 0.5  # the Poisson rates, as fractions of the saturated request throughput
READY_TIMEOUT = 900.0  # seconds a server may take to load and compile
# vLLM's server closes a connection idle for 5 s, less than the load generator keeps it (60 s): at a Poisson
# rate a request sent on a connection the server is closing then fails ("Server disconnected"). It keeps
# them as long as vattn's server does, which closes none before the client does.
PEER_KEEP_ALIVE = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vattn.models import BUILT_IN

    p.add_argument("--model", choices=BUILT_IN, default=BUILT_IN[0], help="the model both servers serve")
    p.add_argument("--num-prompts", type=int, default=200, help="requests of each round")
    p.add_argument("--max-tokens", type=int, default=128, help="cap on each answer")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each rate; each figure is their median")
    p.add_argument("--request-rate", type=float, nargs=2, metavar=("BUSY", "CALM"),
                   help=f"the two Poisson rates, requests/s (default: {BUSY} and {CALM} × vLLM's saturated rate)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="servers to run")
    p.add_argument("--quick", action="store_true", help="a smaller run: 16 requests, answers ≤ 16 tokens, 1 round")
    p.add_argument("--log-dir", help="where the servers' and the load generator's logs go (default: a temporary "
                                     "folder)")


def main(args: argparse.Namespace) -> dict:
    sizes = dict(num_prompts=16, max_tokens=16, rounds=1) if args.quick else {}
    return run(args.json, model_name=args.model, dtype=args.dtype, systems=args.systems, rates=args.request_rate,
               log_dir=args.log_dir, **{k: sizes.get(k, getattr(args, k)) for k in ("num_prompts", "max_tokens",
                                                                                        "rounds")})


def dataset(tokenizer, num_prompts: int, max_tokens: int, chunks: int) -> list[list[dict]]:
    """`chunks` disjoint lists of `num_prompts` ShareGPT requests (`sharegpt.sample`) as the entries of a
    ShareGPT JSON file, which `vllm bench serve` reads whole (the packaged file is cut off): the prompt
    through the chat template as text, and the reference reply cut to at most `max_tokens` tokens, whose
    length `vllm bench serve` takes for the answer's."""
    from vattn import sharegpt

    sampled = sharegpt.sample(tokenizer, num_prompts * chunks)
    if len(sampled) < num_prompts * chunks:
        raise ValueError(f"ShareGPT holds {len(sampled)} requests that fit; {chunks} rounds of {num_prompts} "
                         f"need {num_prompts * chunks}")
    entries = [{"id": str(i), "conversations": [
        {"from": "human", "value": tokenizer.decode(sharegpt.chat_prompt(tokenizer, r.prompt))},
        {"from": "gpt", "value": _cut(tokenizer, r.reply, max_tokens)}]} for i, r in enumerate(sampled)]
    return [entries[k * num_prompts:(k + 1) * num_prompts] for k in range(chunks)]


def _cut(tokenizer, text: str, max_tokens: int) -> str:
    """`text`'s first tokens, as many as re-tokenize to at most `max_tokens`."""
    ids = tokenizer(text)["input_ids"]
    keep = min(len(ids), max_tokens)
    while len(tokenizer(cut := tokenizer.decode(ids[:keep]))["input_ids"]) > max_tokens:
        keep -= 1
    return cut


def requests(tokenizer, entries: list[dict]) -> list[dict]:
    """The engine's requests for `entries`, as `vllm bench serve` reads them: the prompt's token ids, and the
    reply's length in tokens for the answer's."""
    return [{"prompt": tokenizer(e["conversations"][0]["value"])["input_ids"],
             "max_tokens": len(tokenizer(e["conversations"][1]["value"])["input_ids"])} for e in entries]


class Server:
    """`system`'s server on a free port, up once `/health` answers 200 (`wait_ready`; by default before the
    constructor returns); the peak PSS of its processes is sampled from its start until `stop_sampling`.
    `where` (the model) and `name` (the name requests use) are left out for a vattn server whose models
    `flags` give (`--model NAME=MODEL`); `flags` are added to the shared ones."""

    def __init__(self, system: str, where: str | None, name: str | None, dtype: str, max_len: int, budget: int,
                 log: Path, flags: tuple[str, ...] = (), wait: bool = True):
        self.system, self.port = system, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        shared = [*(["--served-model-name", name] if name else []), "--dtype", dtype, "--max-model-len", str(max_len),
                  "--kv-cache-memory-bytes", str(budget), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self._log = open(log, "a")
        out = dict(stdout=self._log, stderr=subprocess.STDOUT)
        if system == "vllm":
            self._proc = peers.popen(["-m", "vllm.entrypoints.openai.api_server", "--model", where, *shared,
                                      "--disable-uvicorn-access-log"], extra_env=PEER_KEEP_ALIVE, **out)
        else:
            self._proc = subprocess.Popen([sys.executable, "-m", "vattn", "serve", *([where] if where else []),
                                           *shared], env=allocator.preloaded(dict(os.environ)), **out)
        self._pss = PeakPss(self._proc.pid).start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.system}'s server stopped (exit code {self._proc.returncode}); its log: "
                                   f"{self._log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.system}'s server was not up after {READY_TIMEOUT:.0f} s; its log: {self._log.name}")

    def stop_sampling(self) -> None:
        self._pss.stop()  # why the timed rounds run unobserved: e2e.Worker.stop_sampling

    def peak_memory(self) -> dict:
        return {"peak_pss_bytes": self._pss.stop(), "peak_rss_bytes": tree_peak_rss_bytes(self._proc.pid)}

    def close(self) -> None:
        """SIGTERM; a server that has not exited a minute later is killed."""
        self._pss.stop()
        self._proc.terminate()
        wait_or_kill(self._proc)
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(json_path: str | None, model_name: str = "smollm2", dtype: str = "auto", num_prompts: int = 200,
        max_tokens: int = 128, rounds: int = 3, rates: list[float] | None = None, systems=SYSTEMS,
        log_dir: str | None = None) -> dict:
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    systems = [s for s in SYSTEMS if s in systems]
    if peers.vllm_python() is None:
        raise RuntimeError(f"vllm bench serve is the load generator: {peers.HOW}")
    loaded = e2e.load(model_name, dtype)
    budget, max_len, name = e2e.default_budget(loaded.cache), loaded.engine.max_seq_len, model_name
    chunks = dataset(loaded.tokenizer, num_prompts, max_tokens, 1 + 3 * rounds)  # memory, then each rate's rounds
    log = Path(log_dir or tempfile.mkdtemp(prefix="vattn-bench-serve-"))
    log.mkdir(parents=True, exist_ok=True)
    paths = [log / f"sharegpt_{k}.json" for k in range(len(chunks))]
    for path, entries in zip(paths, chunks):
        path.write_text(json.dumps(entries))
    reqs = [requests(loaded.tokenizer, entries) for entries in chunks]
    gen = LoadGenerator(paths, [[r["max_tokens"] for r in rs] for rs in reqs], name, loaded.where, log,
                        log / "vllm_bench_serve.log")
    console.print(f"serve: {model_name} in {loaded.dtype}, rounds of {num_prompts} ShareGPT requests, answers ≤ "
                  f"{max_tokens} tokens, KV budget {budget / 2**30:.2f} GiB, context {max_len}; logs in {log}")
    servers, engine = {}, None
    try:
        for system in systems:
            console.print(f"starting {system}'s server")
            servers[system] = Server(system, loaded.where, name, loaded.dtype, max_len, budget, log / f"{system}.log")
            console.print(f"{system}: memory round")
            gen.round(servers[system], 0, float("inf"))
            servers[system].stop_sampling()
        if "vattn" in servers:
            engine = _InProcess(loaded, budget, reqs, log)
        rows, in_process = _loads(servers, gen, engine, rounds, rates)
        memory = {system: server.peak_memory() for system, server in servers.items()}
    finally:
        for closing in (engine, *servers.values(), gen):
            if closing is not None:
                closing.close()
    result = {"model": model_name, "dtype": loaded.dtype, **machine(), "num_prompts": num_prompts,
              "max_tokens": max_tokens, "rounds_per_figure": rounds, "kv_budget_bytes": budget, "max_model_len": max_len,
              "rows": rows, "memory": memory, "in_process": in_process}
    result["verdicts"] = verdicts(result)
    _print(result)
    write_json(json_path, result)
    return result


def _loads(servers: dict, gen: LoadGenerator, engine: "_InProcess | None", rounds: int,
           rates: list[float] | None) -> tuple[list[dict], dict | None]:
    """`rounds` rounds of each load, each round served by every server in turn, and at the saturated rate by
    `engine` in the same turn: a row for each server and load, and the engine's figures (None without it).
    The Poisson rates are fractions of the first server's saturated request throughput."""
    rows, in_process, saturated = [], [], None
    for i, load in enumerate(LOADS):
        rate = _rate(load, rates, saturated)
        measured = {system: [] for system in servers}
        for k in range(rounds):
            chunk = 1 + i * rounds + k
            for system, server in servers.items():
                console.print(f"{system}: rate {e2e.rate_label(rate)}, round {k + 1}/{rounds}")
                measured[system].append(gen.round(server, chunk, rate))
            if engine is not None and load == "saturated":
                console.print(f"vattn in process: round {k + 1}/{rounds}")
                in_process.append(engine.round(chunk))
        rows += [{"system": system, "load": load, "request_rate": e2e.rate_label(rate),
                  "figures": median_figures(runs), "rounds": runs} for system, runs in measured.items()]
        saturated = saturated or rows[0]["figures"]["request_throughput"]
    if engine is None:
        return rows, None
    return rows, {"output_tok_per_s": statistics.median(in_process), "rounds": in_process}


def _rate(load: str, given: list[float] | None, saturated: float | None) -> float:
    """The request rate of `load`: inf when saturated; else the one `given`, or its fraction of the saturated
    request throughput."""
    if load == "saturated":
        return float("inf")
    if given:
        return given[LOADS.index(load) - 1]
    return round((BUSY if load == "busy" else CALM) * saturated, 3)


class _InProcess:
    """The engine in a process of its own (`e2e.Worker`), warmed up on the memory round's requests; `round(k)`:
    its output tok/s serving chunk k's requests all at once."""

    def __init__(self, loaded: e2e.Loaded, budget: int, reqs: list[list[dict]], log: Path):
        self.reqs = reqs
        self._worker = e2e.Worker("vattn", {"memory_budget": budget}, log / "in_process.log", loaded.where,
                                  loaded.dtype)
        console.print("vattn in process: warm-up")
        try:
            self.round(0)
        except BaseException:
            self.close()
            raise

    def round(self, chunk: int) -> float:
        reqs = self.reqs[chunk]
        return e2e.figures(self._worker.serve(reqs, [0.0] * len(reqs)), reqs)["output_tok_per_s"]

    def close(self) -> None:
        self._worker.close()


def verdicts(result: dict) -> list[dict]:
    """The targets, each with the figures it compares and whether it is met."""
    by = {(r["system"], r["load"]): r["figures"] for r in result["rows"]}
    out = []

    def target(what: str, value: float, bound: float, at_least: bool) -> None:
        out.append({"target": what, "value": value, "bound": bound, "at_least": at_least,
                    "met": value >= bound if at_least else value <= bound})

    if (saturated := by.get(("vattn", "saturated"))) is not None:
        target("output tok/s, vattn serve over the engine in process, saturated",
               saturated["output_throughput"] / result["in_process"]["output_tok_per_s"], 0.95, True)
    if {"vllm", "vattn"} <= result["memory"].keys():
        target("vattn's peak PSS over vLLM's", result["memory"]["vattn"]["peak_pss_bytes"]
               / result["memory"]["vllm"]["peak_pss_bytes"], 0.5, False)
    for load in LOADS:
        if ("vllm", load) not in by or ("vattn", load) not in by:
            continue
        ours, peer = by[("vattn", load)], by[("vllm", load)]
        target(f"output tok/s, vattn over vLLM, {load}", ours["output_throughput"] / peer["output_throughput"],
               1.0 if load == "saturated" else 0.98, True)
        if load != "saturated":
            for figure in ("median_ttft_ms", "median_tpot_ms"):
                target(f"{figure}, vattn over vLLM, {load}", ours[figure] / peer[figure], 1.0, False)
    if (calm := by.get(("vllm", "calm"))) is not None:
        target("vLLM's median TTFT in ms, calm", calm["median_ttft_ms"], 1000.0, False)
    return out


def _print(result: dict) -> None:
    lat = lambda f, m: f"{f[f'mean_{m}_ms']:,.0f} / {f[f'median_{m}_ms']:,.0f} / {f[f'p99_{m}_ms']:,.0f}"  # noqa: E731
    print_table(f"through the server: {result['num_prompts']} ShareGPT requests a round, {result['model']} "
                f"{result['dtype']}, answers ≤ {result['max_tokens']} tokens, EOS ignored, vllm bench serve; "
                f"medians of {result['rounds_per_figure']} rounds",
                ["server", "load", "rate", "output tok/s", "req/s", "TTFT ms mean / med / p99", "TPOT ms", "ITL ms",
                 "E2EL ms", "peak PSS GiB", "peak RSS GiB"],
                [[r["system"], r["load"], r["request_rate"], f"{f['output_throughput']:.1f}", f"{f['request_throughput']:.2f}",
                  lat(f, "ttft"), lat(f, "tpot"), lat(f, "itl"), lat(f, "e2el"),
                  f"{result['memory'][r['system']]['peak_pss_bytes'] / 2**30:.2f}",
                  f"{result['memory'][r['system']]['peak_rss_bytes'] / 2**30:.2f}"]
                 for r in result["rows"] for f in [r["figures"]]])
    if result["in_process"] is not None:
        console.print(f"vattn's engine in process, rate inf: {result['in_process']['output_tok_per_s']:.1f} output "
                      f"tok/s")
    console.print(f"this machine: {result['cpu']}")
    for v in result["verdicts"]:
        console.print(f"{'met' if v['met'] else 'MISSED'}: {v['target']}: {v['value']:.3g} "
                      f"(target {'≥' if v['at_least'] else '≤'} {v['bound']:g})")
