"""The `vattn` command."""
import argparse
import sys

from vattn import allocator


def info(args) -> None:
    from vattn import info

    info.run()


def generate(args) -> None:
    from vattn import generate

    generate.run(args.prompt, args.max_new_tokens, args.num_beams, args.cache, args.dtype)


def demo(args) -> None:
    from vattn import demo

    demo.run(args.num_prompts, args.max_tokens, args.show, args.json, args.tensor_parallel_size, args.dtype)


def bench_vmm(args) -> None:
    from vattn.bench import vmm

    vmm.run(args.json, repeats=args.repeats, steps=args.steps, device=args.device)


def bench_hf(args) -> None:
    from vattn.bench import hf

    hf.run(args.json, batches=args.batches, new_tokens=args.new_tokens, attn=args.attn, dtype=args.dtype)


def bench_engine(args) -> None:
    from vattn.bench import engine

    seqs, tokens = (_one(args, name) for name in ("max_num_seqs", "max_num_batched_tokens"))
    engine.run(args.json, num_prompts=args.num_prompts, max_tokens=args.max_tokens, max_num_seqs=seqs,
               max_num_batched_tokens=tokens, device=args.device, rounds=args.rounds, attention=args.attention,
               tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype)


def bench_sweep(args) -> None:
    from vattn.bench import sweep
    from vattn.engine.config import EngineConfig

    limits = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_running_tokens": args.max_running_tokens or [EngineConfig().max_running_tokens]}
    sweep.run(args.json, limits, workload=args.workload, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
              rate=args.request_rate, rounds=args.rounds, dtype=args.dtype)


def bench_soak(args) -> None:
    from vattn.bench import soak

    soak.run(args.json, num_requests=args.requests, chaos=args.chaos)


def bench_memory(args) -> None:
    from vattn.bench import memory

    memory.run(args.json, args.plot, args.traces, args.models, args.requests, args.budget,
               tuple(args.policies or memory.POLICIES))


def bench_kernels(args) -> None:
    from vattn.bench import kernels

    kernels.run(args.json, args.plot, batches=args.batches, contexts=args.contexts, dtypes=args.dtypes,
                repeats=args.repeats, device=args.device)


def bench_linears(args) -> None:
    from vattn.bench import linears

    linears.run(args.json, rows=args.rows, repeats=args.repeats, dtype=args.dtype)


def bench_gpu(args) -> None:
    from vattn.bench import gpu

    sys.exit(gpu.run(args.json, num_prompts=args.num_prompts, max_tokens=args.max_tokens))


def bench_e2e(args) -> None:
    from vattn.bench import e2e

    sizes = e2e.QUICK if args.quick else {}
    e2e.run(args.json, args.plot, workload=args.workload, num_prompts=args.num_prompts or sizes.get("num_prompts"),
            max_tokens=args.max_tokens or sizes.get("max_tokens"), rates=args.request_rate,
            burstiness=args.burstiness, rounds=args.rounds, systems=args.systems, kv_budget=args.kv_budget,
            log_dir=args.log_dir, model_name=args.model, dtype=args.dtype)


def _one(args, name: str) -> int | None:
    """A setting given at most once (None: the engine's default)."""
    values = getattr(args, name)
    if values and len(values) > 1:
        raise SystemExit(f"vattn bench engine: --{name.replace('_', '-')} takes one value (several: bench sweep)")
    return values[0] if values else None


def _tokens(text: str) -> int | None:
    """A token count, or none."""
    return None if text.lower() == "none" else int(text)


DEMO_PROMPTS, DEMO_MAX_TOKENS = 32, 48


def add_dtype(p: argparse.ArgumentParser) -> None:
    from vattn.dtypes import SETTINGS

    p.add_argument("--dtype", choices=list(SETTINGS), default="auto",
                   help="the model's dtype (auto: its checkpoint's, float32 on a CPU without bfloat16 instructions)")


def add_bench_commands(bench: argparse.ArgumentParser) -> None:
    """`vattn bench NAME`, each benchmark with its own options."""
    from vattn.serve.sizes import byte_size

    names = bench.add_subparsers(dest="what", required=True, metavar="NAME")

    def command(name: str, func, help: str, outputs: str = "json") -> argparse.ArgumentParser:
        p = names.add_parser(name, help=help, description=help)
        p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
        if outputs == "json+plot":
            p.add_argument("--plot", metavar="DIR", help="also write PNG charts there")
        p.set_defaults(func=func)
        return p

    def device(p, *choices):
        p.add_argument("--device", choices=choices or ["cpu", "cuda"], default="cpu", help="where to run")

    def repeats(p):
        p.add_argument("--repeats", type=int, default=15, help="runs per measurement (median reported)")

    def rounds(p):
        p.add_argument("--rounds", type=int, default=3, help="rounds per figure (median reported)")

    def workload(p):
        from vattn.bench.e2e import WORKLOADS

        p.add_argument("--workload", choices=list(WORKLOADS), default="sharegpt", help="first turns, or long chats")

    p = command("vmm", bench_vmm, "map/unmap µs per page: batched vs single-page vs a raw C loop; mapping time a "
                                  "decode step (--device cuda: the driver's VMM calls)")
    repeats(p)
    device(p)
    p.add_argument("--steps", type=int, default=512, help="decode steps to time")

    p = command("hf", bench_hf, "generate() throughput and KV bytes: VAttnCache vs DynamicCache vs StaticCache")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[512, 2048], help="tokens to generate")
    p.add_argument("--attn", choices=["sdpa", "vattn_sdpa", "vattn_native", "eager"], default="sdpa",
                   help="attention implementation for every cache")
    add_dtype(p)

    p = command("engine", bench_engine, "the demo's workload, larger, through the engine, with and without the "
                                        "mapping worker")
    p.add_argument("--num-prompts", type=int, default=64, help="requests")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each answer")
    p.add_argument("--max-num-seqs", type=int, nargs="+", help="sequences at once (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", help="tokens a forward (default: the engine's)")
    p.add_argument("--attention", choices=["native", "flash", "triton", "sdpa"],
                   help="the attention kernel (default: the first that serves, vattn.attention.registry)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model's heads are split over")
    add_dtype(p)
    device(p)
    rounds(p)

    p = command("sweep", bench_sweep, "bench e2e's workload through the engine at each set of batch limits")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[16, 32, 64, 128], help="values to try")
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[256, 512, 1024], help="values to try")
    p.add_argument("--max-running-tokens", type=_tokens, nargs="+",
                   help="values to try, none for no limit (default: the engine's)")
    workload(p)
    p.add_argument("--num-prompts", type=int, help="requests (default: the workload's)")
    p.add_argument("--max-tokens", type=int, help="cap on each answer (default: the workload's)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    add_dtype(p)
    rounds(p)

    p = command("soak", bench_soak, "requests on a tiny model under preemption, each mode: outputs equal the "
                                    "unpressured run's, each request comes back once, the pool ends whole")
    p.add_argument("--requests", type=int, default=2000, help="requests per preemption mode")
    p.add_argument("--chaos", action="store_true", help="poison 5%% of the requests (failing logits processors, "
                                                        "aborts, invalid input)")

    from vattn.bench.memory import MODELS, POLICIES, TRACES

    p = command("memory", bench_memory, "replay real traffic through every KV policy, no model", "json+plot")
    p.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES), help="traces")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="KV geometries")
    p.add_argument("--requests", type=int, default=500, help="requests per trace")
    p.add_argument("--budget", type=byte_size,
                   help="KV memory in bytes, e.g. 60GiB (default: per model, small enough that memory bounds the batch)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, help="policies (default: all)")

    p = command("kernels", bench_kernels, "decode / prefill attention over every KV layout, vattn's kernels vs "
                                          "vLLM's, against the read-bandwidth floor", "json+plot")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                   help="batch sizes (the largest also with mixed lengths)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="context lengths")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                   help="dtypes")
    repeats(p)
    device(p)

    p = command("linears", bench_linears, "one forward's GEMMs: vattn's own vs oneDNN vs F.linear vs vLLM's")
    p.add_argument("--rows", type=int, nargs="+", help="GEMM rows (1 8 32 48 64 128 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' and rows' dtype")
    repeats(p)

    from vattn.bench.e2e import SYSTEMS

    p = command("e2e", bench_e2e, "vattn vs paged_16 vs vLLM's CPU engine vs transformers' serving paths, end to "
                                  "end", "json+plot")
    workload(p)
    p.add_argument("--num-prompts", type=int, help="requests (sharegpt 48, long 32)")
    p.add_argument("--max-tokens", type=int, help="cap on each answer (sharegpt 128, long 256)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s (inf: all at once); several make a sweep")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    rounds(p)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                   help=f"systems to run (default: {' '.join(SYSTEMS)}; paged_N for other block sizes, "
                        "vattn_compiled for the engine with compile=True)")
    p.add_argument("--kv-budget", type=byte_size,
                   help="KV bytes of every system, e.g. 2GiB (default: 32 sequences of 2,048 tokens)")
    p.add_argument("--quick", action="store_true", help="a smaller run (12 requests, answers ≤ 32 tokens)")
    p.add_argument("--log-dir", help="where the systems' logs go (default: a temporary folder)")
    from vattn.models import BUILT_IN

    p.add_argument("--model", choices=BUILT_IN, default=BUILT_IN[0],
                   help="the model every system serves (the shapes: random weights, vattn.models)")
    add_dtype(p)

    from vattn.bench import models, serve

    p = command("serve", serve.main, "vattn serve vs vllm serve under vllm bench serve, and vs the engine in process")
    serve.add_arguments(p)
    add_dtype(p)
    p = command("models", models.main, "three models with staggered peaks: one shared KV pool vs static thirds vs "
                                       "one vllm serve a model", "json+plot")
    models.add_arguments(p)
    add_dtype(p)

    p = command("gpu", bench_gpu, "the GPU check (scripts/gpu_check.sh): CUDA tests, VMM latency, kernels, a short "
                                  "engine run, a summary table")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the engine part")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each answer")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a command: under tcmalloc where it is installed
        allocator.run_with_tcmalloc()
    parser = argparse.ArgumentParser(prog="vattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="backend, page size, VMM limits, versions").set_defaults(func=info)
    from vattn.generate import CACHES, DEFAULT_PROMPT

    p = commands.add_parser("generate", help="chat with SmolLM2 on a KV cache of choice")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--cache", choices=CACHES, default="vattn")
    add_dtype(p)
    p.set_defaults(func=generate)
    p = commands.add_parser("demo", help="SmolLM2 serves real ShareGPT prompts through the engine")
    p.add_argument("--num-prompts", type=int, default=DEMO_PROMPTS)
    p.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS, help="cap on each answer's length")
    p.add_argument("--show", type=int, default=3, help="prompts to print with their answers")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model's heads are split over")
    add_dtype(p)
    p.set_defaults(func=demo)
    from vattn.serve.options import add_arguments

    add_arguments(commands.add_parser("serve", help="an OpenAI-compatible server over the engine (vattn[serve])"))
    add_bench_commands(commands.add_parser("bench", help="benchmarks (vattn bench NAME --help: its options)"))
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
