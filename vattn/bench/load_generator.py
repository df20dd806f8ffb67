"""`vllm bench serve`, vLLM's own load generator, driving a server of `vattn
bench serve` one round at a time (the peer's script `vllm_bench_serve.py`)."""
import json
import subprocess
from pathlib import Path

from vattn.bench import peers
from vattn.bench.processes import wait_or_kill

# what `vllm bench serve` reports per request; the figures are the rest
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
               "generated_texts", "errors")


class LoadGenerator:
    """`vllm bench serve` against one server, one round at a time, over the dataset's chunks (files): one
    process of the peer's (`vllm_bench_serve.py`) runs every round, started here so that it imports vLLM
    while the first server loads; `close` ends it."""

    def __init__(self, chunks: list[Path], expected: list[list[int]], name: str, tokenizer: str, work: Path,
                 log: Path):
        self.chunks, self.expected, self.name, self.tokenizer = chunks, expected, name, tokenizer
        self.work, self._log = work, open(log, "a")
        self._proc = peers.popen([str(peers.script("vllm_bench_serve"))], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self._log, text=True)

    def round(self, server, chunk: int, rate: float) -> dict:
        """Sends chunk `chunk` to `server` (a `serve.Server`) at `rate` requests/s (inf: all at once) and returns
        what `vllm bench serve` measured, once every request is answered in full."""
        n = len(self.expected[chunk])
        out = f"{server.system}_{chunk}.json"
        argv = ["--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
                "--model", self.name, "--served-model-name", self.name, "--tokenizer", self.tokenizer,
                "--dataset-name", "sharegpt", "--dataset-path", str(self.chunks[chunk]), "--disable-shuffle",
                "--num-prompts", str(n), "--request-rate", str(rate), "--burstiness", "1", "--seed", "0",
                "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
                "--metric-percentiles", "50,99", "--save-result", "--save-detailed", "--result-dir", str(self.work),
                "--result-filename", out, "--disable-tqdm"]
        self._log.write(f"\n== {server.system}, chunk {chunk}, rate {rate}\n")
        self._log.flush()
        self._proc.stdin.write(json.dumps(argv) + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"vllm bench serve stopped (exit code {self._proc.wait()}); its log: {self._log.name}")
        if "error" in (answer := json.loads(answer)):
            raise RuntimeError(f"vllm bench serve failed: {answer['error']}; its log: {self._log.name}")
        result = json.loads((self.work / out).read_text())
        if result["completed"] != n or result["output_lens"] != self.expected[chunk]:
            errors = sorted({e.strip().splitlines()[-1] for e in result["errors"] if e.strip()})  # last lines
            raise RuntimeError(f"{server.system}: {result['completed']} of {n} requests answered in full at rate "
                               f"{rate}; errors: {errors[:3]}")
        return {k: v for k, v in result.items() if k not in PER_REQUEST and isinstance(v, (int, float))}

    def close(self) -> None:
        self._proc.stdin.close()  # the script's loop ends
        wait_or_kill(self._proc)
        self._log.close()
