"""`vattn serve`'s flags: vLLM's names wherever vLLM has the setting."""
import argparse
import re

from vattn import dtypes, models

SIZES = {"": 1, "b": 1, "kib": 2**10, "kb": 10**3, "k": 2**10, "mib": 2**20, "mb": 10**6, "m": 2**20,
         "gib": 2**30, "gb": 10**9, "g": 2**30}


def byte_size(text: str) -> int:
    """Bytes from "1073741824", "60e9", "512MiB", "2GiB" or "1.5GB"; at least one."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in SIZES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: bytes, or a number with KiB, MiB, GiB, KB, MB, GB")
    size = int(float(match[1]) * SIZES[match[2].lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: it must be at least one byte")
    return size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=f"a checkpoint's name or directory, or a built-in model ({', '.join(models.BUILT_IN)}); "
                        f"default {models.DEFAULT}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name requests use (default: the model as given)")
    p.add_argument("--api-key", help="requests to /v1 must carry Authorization: Bearer KEY")
    p.add_argument("--dtype", default="auto", choices=list(dtypes.SETTINGS), help="vattn.dtypes")
    p.add_argument("--max-model-len", type=int, help="the context: prompt and answer (the engine's max_seq_len)")
    p.add_argument("--max-num-seqs", type=int, help="sequences at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens of one forward")
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, help="the KV memory budget: bytes, or 512MiB, 2GiB")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--preemption-mode", choices=["recompute", "swap"])
    p.add_argument("--max-waiting-requests", type=int,
                   help="answer 503 at once while this many requests wait (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from vattn.serve.server import main  # uvicorn and FastAPI load only here

    main(args)
