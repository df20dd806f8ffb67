"""Tensor parallelism on torch.distributed: one scheduler, a cache per rank.

`launch(size, model, settings)` makes the ranks: on one machine this process
is rank 0 and starts ranks 1..size-1 itself (`torch.multiprocessing`,
spawned); under `torchrun` every process runs the same entry point, joins
the group torchrun describes, and only rank 0 returns to serve (the others
serve rank 0 until it closes, then exit).  gloo carries the group on the
CPU, NCCL on CUDA.

Every rank loads its shard of the model through transformers' own
tensor-parallel plan (`DistributedConfig(tp_size=size)`: DTensor weights,
each rank's attention over its own query and KV heads), so vattn shards
nothing itself, and builds its own cache over its own KV heads.  Each step
rank 0 broadcasts one `Message`: the cache calls its scheduler made since
the last (`vattn.engine.lockstep`) and the forward's inputs; every rank
replays the calls, runs the same forward, and the model's own collectives
join the shards.  Only rank 0 samples.

A rank that fails reports its error in the group's store and exits; rank
0's next collective then fails at once, and it raises `RankFailed` naming
the rank and its error and shuts the others down (terminate, then kill, a
few seconds each).  A rank that dies is found the same way.
"""
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from vattn.engine.plan import StepInputs

FAILED = "vattn/failed/{}"  # the store key a rank's error goes under
TIMEOUT = timedelta(days=1)  # a collective's limit: ranks wait for rank 0's next step as long as it idles
GRACE = 5.0  # seconds a rank is given to report its error, then to exit when told


class RankFailed(RuntimeError):
    """A tensor-parallel rank failed or died; the engine can serve no more."""


@dataclass(slots=True)
class Message:
    """Rank 0's word to the others, once a step."""

    ops: list[tuple]  # cache calls to replay, in order
    inputs: StepInputs | None = None  # the forward to run, if any
    query: str | None = None  # "books": check and send back the page books; "stop": exit


@dataclass
class Group:
    """This process's place among the ranks."""

    rank: int
    size: int
    processes: list = field(default_factory=list)  # the ranks this process started, if it did
    closed: bool = False
    threads: int | None = None  # torch's threads here before the ranks split the cores; given back at shutdown

    @property
    def store(self):
        return dist.distributed_c10d._get_default_store()

    def send(self, message: Message) -> None:
        dist.broadcast_object_list([message], src=0)

    def receive(self) -> Message:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list | None:
        """Every rank's `value` on rank 0 (None elsewhere)."""
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0)
        return out

    def report(self, error: BaseException) -> None:
        """Leave this rank's error where rank 0 looks when a collective fails."""
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        try:
            self.store.set(FAILED.format(self.rank), text)
        except Exception:  # the store went with rank 0: nobody is left to tell
            pass

    def failure(self, error: BaseException) -> RankFailed:
        """What rank 0 raises when a collective or forward failed, once it has
        shut the other ranks down: each other rank's reported error or exit
        status (waiting up to `GRACE` seconds for one to show), else `error`
        itself."""
        deadline = time.monotonic() + GRACE
        while True:
            reports = self._reports()
            if reports or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        why = "; ".join(f"rank {r}: {text}" for r, text in sorted(reports.items()))
        self.shutdown()
        return RankFailed(f"tensor-parallel rank failed ({why or f'rank 0: {type(error).__name__}: {error}'}); "
                          f"the other ranks are shut down")

    def _reports(self) -> dict[int, str]:
        reports = {}
        for r in range(1, self.size):
            key = FAILED.format(r)
            try:
                if self.store.check([key]):
                    reports[r] = self.store.get(key).decode()
            except Exception:
                pass
        for r, p in enumerate(self.processes, start=1):
            if r not in reports and p.exitcode is not None and p.exitcode != 0:
                reports[r] = f"exited with status {p.exitcode}"
        return reports

    def shutdown(self) -> None:
        """Rank 0: make sure no rank it started outlives it, within bounded time."""
        if self.closed:
            return
        self.closed = True
        for p in self.processes:
            p.join(GRACE)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(GRACE)
            if p.is_alive():
                p.kill()
                p.join(GRACE)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone
                pass
        if self.threads is not None:
            torch.set_num_threads(self.threads)


def backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(size: int, model, settings: dict, device_type: str = "cpu") -> Group:
    """Rank 0's `Group` of `size` ranks (`model`, `settings`: what every rank
    loads and serves, see `load` and `EngineConfig`).  Under torchrun a
    process of another rank serves here and exits when rank 0 closes."""
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size}, but torchrun started {world} processes")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend(device_type), timeout=TIMEOUT)
        group = Group(dist.get_rank(), size)
        if group.rank != 0:
            serve(group, model, settings)
            # destroyed before the interpreter's finalization, which gloo's threads do not survive (SIGABRT)
            dist.destroy_process_group()
            sys.exit(0)
        return group
    port = _free_port()
    context = torch.multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(rank, size, port, model, settings, device_type),
                                 daemon=True, name=f"vattn-rank-{rank}") for rank in range(1, size)]
    for p in processes:
        p.start()
    group = Group(0, size, processes, threads=torch.get_num_threads())
    torch.set_num_threads(_threads(size))
    joining = threading.Thread(target=_join, args=(0, size, port, device_type), daemon=True)
    joining.start()
    while joining.is_alive():  # a rank that dies before it joins would keep rank 0 waiting
        joining.join(0.05)
        if any(p.exitcode is not None for p in processes):
            group.shutdown()
            raise RankFailed(f"tensor-parallel rank failed before joining the group "
                             f"({'; '.join(f'rank {r}: {text}' for r, text in group._reports().items())})")
    if not dist.is_initialized():
        group.shutdown()
        raise RankFailed("rank 0 could not join the tensor-parallel group")
    return group


def _join(rank: int, size: int, port: int, device_type: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)  # transformers binds each rank's device by it
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend(device_type), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=TIMEOUT)


def _rank_main(rank: int, size: int, port: int, model, settings: dict, device_type: str) -> None:
    """A rank rank 0 started: serve, and exit; on any error, report it and exit at once."""
    torch.set_num_threads(_threads(size))
    _join(rank, size, port, device_type)
    serve(Group(rank, size), model, settings)
    os._exit(0)


def serve(group: Group, model, settings: dict) -> None:
    """A rank other than 0: load its shard, build its cache, then replay and
    run rank 0's steps until told to stop.  An error is reported and ends
    the process (closing its connections, so rank 0's collective fails at
    once instead of waiting)."""
    from vattn.engine.config import EngineConfig
    from vattn.engine.lockstep import Replica, books
    from vattn.engine.llm_engine import build_cache
    from vattn.engine.model_runner import ModelRunner

    try:
        shard, _ = load(model, group.size, with_tokenizer=False)
        config = EngineConfig(**settings).for_model(shard)
        cache, kv = build_cache(shard, config)
        runner = ModelRunner(shard, cache, config.attention, pack=False, fuse=False, own_forward=False)
        replica = Replica(kv)
        dist.barrier()  # loaded: rank 0 waits for every rank here
        while True:
            message = group.receive()
            replica.replay(message.ops)
            if message.inputs is not None:
                batch = runner.batch(message.inputs)
                reads = runner.zero_fill_range(batch)
                if reads:
                    cache.zero_fill(*reads)
                runner.run(message.inputs, batch)
            if message.query == "books":
                kv.check()
                group.gather(books(kv))
            elif message.query == "stop":
                runner.close()
                return
    except BaseException as e:
        group.report(e)
        os._exit(1)


def device_type() -> str:
    """Where tensor-parallel ranks run: one GPU each where there are GPUs."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_here(model, group: Group | None):
    """(the model, or rank 0's shard of it, and its tokenizer), once every
    rank of `group` has loaded its own."""
    if group is None:
        return load(model, 1)
    try:
        loaded = load(model, group.size)
        dist.barrier()
    except BaseException as e:
        raise group.failure(e) from e
    return loaded


def load(model, size: int, with_tokenizer: bool = True):
    """(this rank's shard of the model, its tokenizer or None).  `model`: None
    (SmolLM2-135M-Instruct, float32), a transformers checkpoint's name or
    directory, or a loader: a picklable function taking `from_pretrained`'s
    keywords (`distributed_config`, for a shard) and giving back (model,
    tokenizer).  One rank (`size` 1) loads the whole model."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    shard = {"distributed_config": DistributedConfig(tp_size=size)} if size > 1 else {}
    if callable(model):
        loaded, tokenizer = model(**shard)
    elif model is None:
        from vattn.models import ENGINE_DTYPE, load_smollm2

        loaded, tokenizer = load_smollm2(dtype=ENGINE_DTYPE, **shard)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto", **shard).eval()
        tokenizer = _tokenizer(model) if with_tokenizer else None
    if size > 1:
        check_shardable(loaded.config, size)
    return loaded, tokenizer


def check_shardable(config, size: int) -> None:
    """Refuse a model its tensor-parallel plan cannot split into `size` ranks."""
    c = config.get_text_config()
    if not getattr(c, "base_model_tp_plan", None):
        raise ValueError(f"tensor parallelism needs transformers' tensor-parallel plan, and {c.model_type} has "
                         f"none (covered: every architecture whose config has base_model_tp_plan, such as "
                         f"llama, qwen2, mistral)")
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    if kv_heads % size or heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {heads} attention heads and "
                         f"{kv_heads} KV heads (each rank holds its own)")


def check_settings(size: int, model, device_type: str) -> None:
    """Refuse a tensor-parallel size before any process starts: it must
    divide the model's heads (read from its config where `model` names one)
    and, on CUDA, not exceed the devices."""
    if device_type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices; "
                         f"{torch.cuda.device_count()} are visible")
    if size > 1 and not callable(model):
        from transformers import AutoConfig

        if model is None:
            from vattn.models import smollm2_dir

            model = smollm2_dir()
        check_shardable(AutoConfig.from_pretrained(model), size)


def _tokenizer(name):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError):  # a checkpoint without one: prompts go as token ids
        return None


def _threads(size: int) -> int:
    """Each rank's share of this machine's cores."""
    return max(1, (os.cpu_count() or 1) // size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
