"""A `vattn serve` process on a free port, for the server tests, and the
tiny model with SmolLM2's tokenizer it serves where the tokens' meaning
does not matter."""
import contextlib
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_SECONDS = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(to: Path) -> Path:
    """A 4-layer Llama with SmolLM2's tokenizer and vocabulary, random weights (seeded)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from vattn import models

    tokenizer = AutoTokenizer.from_pretrained(models.model_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, dtype="float32")
    LlamaForCausalLM(config).save_pretrained(to)
    tokenizer.save_pretrained(to)
    return to


class Served:
    """A server process: `url`, `base` (for the openai client), its log."""

    def __init__(self, model: str | None, *flags: str, log: Path, script: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base = self.url + "/v1"
        self.log = log
        argv = ["serve", *([model] if model else []), "--port", str(self.port), *flags]
        # `script` runs first in the server process (a fault to inject), then the server
        code = f"{script or ''}\nimport sys\nfrom vattn.cli import main\nsys.exit(main({argv!r}))"
        self.process = subprocess.Popen([sys.executable, "-c", code], stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"the server did not answer /health in {START_SECONDS} s:\n{log.read_text()[-3000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """The value of `vattn:NAME` (its first series with `labels`) from /metrics."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            series, _, value = line.rpartition(" ")
            if series.split("{")[0] == f"vattn:{name}" and all(f'{k}="{v}"' in series for k, v in labels.items()):
                return float(value)
        raise KeyError(name)

    def terminate(self, timeout: float) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
