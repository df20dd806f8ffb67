"""The `vattn` command."""
import argparse
import os
import platform
import sys


def info(args) -> None:
    import torch

    import vattn
    from vattn.backends import get_backend
    from vattn.backends.cuda import unavailable
    from vattn.report import print_table
    from vattn.config import DEFAULTS

    backend = get_backend("cpu")
    why = unavailable()
    if why is None:
        gpu = get_backend("cuda")
        cuda = f"ready: {torch.cuda.get_device_name(gpu.device)}, pages of {gpu.granularity >> 20} MiB"
    else:
        cuda = f"unavailable: {why}"
    with open("/proc/sys/vm/max_map_count") as f:
        max_maps = int(f.read())
    with open("/proc/self/maps") as f:
        maps_now = sum(1 for _ in f)
    print_table("vattn", ["", "value"], [
        ["vattn", vattn.__version__],
        ["host backend", f"{backend.name} (mmap + memfd)"],
        ["OS page size / granularity", f"{backend.granularity} B"],
        ["default page size, layout (host)", f"{_size(DEFAULTS['cpu']['page_size'])}, {DEFAULTS['cpu']['layout']}"],
        ["default page size, layout (CUDA)", f"the driver's granularity, {DEFAULTS['cuda']['layout']}"],
        ["CUDA backend", cuda],
        ["tensor parallelism", _distributed()],
        ["vm.max_map_count", max_maps],
        ["mappings in this process", maps_now],
        ["torch", torch.__version__],
        ["CUDA available to torch", torch.cuda.is_available()],
        ["python", platform.python_version()],
        ["CPUs", os.cpu_count()],
    ])


def _distributed() -> str:
    """What `tensor_parallel_size` > 1 runs on here."""
    import torch.distributed as dist

    from vattn.engine import parallel

    if not dist.is_available():
        return "unavailable: torch was built without torch.distributed"
    backends = "gloo" + (", nccl" if dist.is_nccl_available() else "")
    where = parallel.device_type()
    launch = ("torchrun (RANK, WORLD_SIZE set): every process one rank" if parallel.launched_by_torchrun()
              else "ranks spawned on this machine, or torchrun across machines")
    return f"torch.distributed ({backends}): ranks on {where} over {parallel.backend(where)}; {launch}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def generate(args) -> None:
    from vattn import generate

    generate.run(args.prompt, args.max_new_tokens, args.num_beams, args.cache)


def demo(args) -> None:
    from vattn import demo

    demo.run(args.num_prompts, args.max_tokens, args.show, args.json, args.tensor_parallel_size)


def bench(args) -> None:
    if args.what == "vmm":
        from vattn.bench import vmm

        vmm.run(args.json, repeats=args.repeats, steps=args.steps, device=args.device)
    elif args.what == "hf":
        from vattn.bench import hf

        hf.run(args.json, batches=args.batches or [1, 8], new_tokens=args.new_tokens, attn=args.attn)
    elif args.what == "engine":
        from vattn.bench import engine

        seqs, tokens = (_one(args, name) for name in ("max_num_seqs", "max_num_batched_tokens"))
        engine.run(args.json, num_prompts=args.num_prompts or 64, max_tokens=args.max_tokens or 64,
                   max_num_seqs=seqs, max_num_batched_tokens=tokens, device=args.device, rounds=args.rounds,
                   attention=args.attention, tensor_parallel_size=args.tensor_parallel_size)
    elif args.what == "sweep":
        from vattn.bench import sweep
        from vattn.engine import EngineConfig

        limits = {"max_num_seqs": args.max_num_seqs or [16, 32, 64, 128],
                  "max_num_batched_tokens": args.max_num_batched_tokens or [256, 512, 1024],
                  "max_running_tokens": args.max_running_tokens or [EngineConfig().max_running_tokens]}
        sweep.run(args.json, limits, workload=args.workload, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                  rate=args.request_rate[0], rounds=args.rounds)
    elif args.what == "soak":
        from vattn.bench import soak

        soak.run(args.json, num_requests=args.requests or 2000, chaos=args.chaos)
    elif args.what == "memory":
        from vattn.bench import memory

        memory.run(args.json, args.plot, args.traces, args.models, args.requests or 500, _bytes(args.budget),
                   tuple(args.policies or memory.POLICIES))
    elif args.what == "kernels":
        from vattn.bench import kernels

        kernels.run(args.json, args.plot, batches=args.batches or [1, 8, 32], contexts=args.contexts,
                    dtypes=args.dtypes, repeats=args.repeats, device=args.device)
    elif args.what == "linears":
        from vattn.bench import linears

        linears.run(args.json, rows=args.rows, repeats=args.repeats)
    elif args.what == "gpu":
        from vattn.bench import gpu

        sys.exit(gpu.run(args.json, num_prompts=args.num_prompts or 64, max_tokens=args.max_tokens or 64))
    elif args.what == "e2e":
        from vattn.bench import e2e

        sizes = e2e.QUICK if args.quick else {}
        e2e.run(args.json, args.plot, workload=args.workload, num_prompts=args.num_prompts or sizes.get("num_prompts"),
                max_tokens=args.max_tokens or sizes.get("max_tokens"), rates=args.request_rate,
                burstiness=args.burstiness, rounds=args.rounds, systems=args.systems, kv_budget=_bytes(args.kv_budget),
                log_dir=args.log_dir)


def _one(args, name: str) -> int | None:
    """A setting given at most once (None: the engine's default)."""
    values = getattr(args, name)
    if values and len(values) > 1:
        raise SystemExit(f"vattn bench {args.what}: --{name.replace('_', '-')} takes one value (several: bench sweep)")
    return values[0] if values else None


def _tokens(text: str) -> int | None:
    """A token count, or none."""
    return None if text.lower() == "none" else int(text)


def _bytes(text: str | None) -> int | None:
    """'8GiB', '512MiB', '80e9' or a plain byte count."""
    if text is None:
        return None
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    unit = next((u for u in units if low.endswith(u)), None)
    try:
        value = float(low[:-len(unit)] if unit else low) * (units[unit] if unit else 1)
    except ValueError:
        raise SystemExit(f"--budget: cannot read {text!r} as bytes (e.g. 8GiB, 512MiB, 60e9)") from None
    if value < 1:
        raise SystemExit(f"--budget must be positive, got {text!r}")
    return int(value)


DEMO_PROMPTS, DEMO_MAX_TOKENS = 32, 48


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="backend, page size, VMM limits, versions").set_defaults(func=info)
    from vattn.generate import CACHES, DEFAULT_PROMPT

    p = commands.add_parser("generate", help="chat with SmolLM2 on a KV cache of choice")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--cache", choices=CACHES, default="vattn")
    p.set_defaults(func=generate)
    p = commands.add_parser("demo", help="SmolLM2 serves real ShareGPT prompts through the engine")
    p.add_argument("--num-prompts", type=int, default=DEMO_PROMPTS)
    p.add_argument("--max-tokens", type=int, default=DEMO_MAX_TOKENS, help="cap on each answer's length")
    p.add_argument("--show", type=int, default=3, help="prompts to print with their answers")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model's heads are split over")
    p.set_defaults(func=demo)
    p = commands.add_parser("bench", help="benchmarks")
    p.add_argument("what", choices=["vmm", "hf", "engine", "sweep", "soak", "memory", "kernels", "linears", "e2e",
                                    "gpu"])
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--plot", metavar="DIR", help="memory, kernels, e2e: also write PNG charts there")
    p.add_argument("--repeats", type=int, default=15, help="runs per measurement (median reported)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="vmm, kernels, engine: where to run")
    p.add_argument("--steps", type=int, default=512, help="vmm: decode steps to time")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[512, 2048], help="hf: tokens to generate")
    p.add_argument("--batches", type=int, nargs="+",
                   help="hf, kernels: batch sizes (hf: 1 8; kernels: 1 8 32, the largest also with mixed lengths)")
    p.add_argument("--rows", type=int, nargs="+", help="linears: GEMM rows (1 8 32 48 64 128 512)")
    p.add_argument("--attn", choices=["sdpa", "vattn_sdpa", "vattn_native", "eager"], default="sdpa",
                   help="hf: attention implementation for every cache")
    p.add_argument("--num-prompts", type=int, help="engine (64), e2e (sharegpt 48, long 32): requests")
    p.add_argument("--max-tokens", type=int, help="engine (64), e2e (sharegpt 128, long 256): cap on each answer")
    p.add_argument("--max-num-seqs", type=int, nargs="+",
                   help="engine: sequences at once (default: the engine's); sweep: values to try (16 32 64 128)")
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+",
                   help="engine: tokens a forward (default: the engine's); sweep: values to try (256 512 1024)")
    p.add_argument("--max-running-tokens", type=_tokens, nargs="+",
                   help="sweep: values to try, none for no limit (default: the engine's)")
    p.add_argument("--attention", choices=["native", "flash", "triton", "sdpa"],
                   help="engine: the attention kernel (default: the first that serves, vattn.attention.registry)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="engine: ranks the model's heads are split over")
    p.add_argument("--requests", type=int, help="soak: requests per preemption mode (2000); memory: per trace (500)")
    p.add_argument("--chaos", action="store_true", help="soak: poison 5%% of the requests (failing logits "
                   "processors, aborts, invalid input)")
    from vattn.bench.memory import MODELS, POLICIES, TRACES

    p.add_argument("--traces", nargs="+", choices=list(TRACES), default=list(TRACES), help="memory: traces")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="memory: KV geometries")
    p.add_argument("--budget", help="memory: KV memory in bytes, e.g. 60GiB (default: per model, small enough "
                                    "that memory bounds the batch)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, help="memory: policies (default: all)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192], help="kernels: context lengths")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                   help="kernels: dtypes")
    from vattn.bench.e2e import SYSTEMS, WORKLOADS

    p.add_argument("--workload", choices=list(WORKLOADS), default="sharegpt",
                   help="e2e, sweep: first turns, or long chats")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="e2e: requests/s (inf: all at once), several make a sweep; sweep: the first")
    p.add_argument("--burstiness", type=float, default=1.0, help="e2e: gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--rounds", type=int, default=3, help="e2e, engine, sweep: rounds per figure (median reported)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS),
                   help=f"e2e: systems to run (default: {' '.join(SYSTEMS)}; paged_N for other block sizes, "
                        "vattn_compiled for the engine with compile=True)")
    p.add_argument("--kv-budget", help="e2e: KV memory of every system in bytes, e.g. 2GiB "
                                        "(default: 32 sequences of 2,048 tokens)")
    p.add_argument("--quick", action="store_true", help="e2e: a smaller run (12 requests, answers ≤ 32 tokens)")
    p.add_argument("--log-dir", help="e2e: where the systems' logs go (default: a temporary folder)")
    p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
