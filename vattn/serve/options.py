"""`vattn serve`'s flags: vLLM's names wherever vLLM has the setting."""
import argparse

from vattn import dtypes, models
from vattn.serve.sizes import byte_size


def named(value_type):
    """The type of a NAME=VALUE flag: (name, value_type(value))."""
    def parse(text: str):
        name, sep, value = text.partition("=")
        if not sep or not name or not value:
            raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
        return name, value_type(value)
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=f"a checkpoint's name or directory, or a built-in model ({', '.join(models.BUILT_IN)}); "
                        f"default {models.DEFAULT}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name requests use (default: the model as given)")
    p.add_argument("--model", dest="models", metavar="NAME=MODEL", type=named(str), action="append", default=[],
                   help="serve MODEL under NAME (repeat for several models; they share one KV pool of "
                        "--kv-cache-memory-bytes)")
    p.add_argument("--kv-floor", metavar="NAME=BYTES", type=named(byte_size), action="append", default=[],
                   help="KV memory of the shared pool guaranteed to model NAME")
    p.add_argument("--kv-cap", metavar="NAME=BYTES", type=named(byte_size), action="append", default=[],
                   help="the most KV memory of the shared pool model NAME may hold")
    p.add_argument("--api-key", help="requests to /v1 must carry Authorization: Bearer KEY")
    p.add_argument("--dtype", default="auto", choices=list(dtypes.SETTINGS), help="vattn.dtypes")
    p.add_argument("--max-model-len", type=int, help="the context: prompt and answer (the engine's max_seq_len)")
    p.add_argument("--max-num-seqs", type=int, help="sequences at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens of one forward")
    p.add_argument("--kv-cache-memory-bytes", type=byte_size,
                   help="the KV memory budget (of every model together): bytes, or 512MiB, 2GiB")
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
