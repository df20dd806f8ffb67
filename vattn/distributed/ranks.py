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
the last (`vattn.distributed.lockstep`) and the forward's inputs; every rank
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

import torch
import torch.distributed as dist

from vattn.distributed.group import TIMEOUT, Group, RankFailed, backend
from vattn.distributed.lockstep import Replica, checked_books
from vattn.engine.config import EngineConfig
from vattn.executor.loader import check_shardable, load
from vattn.executor.runner import ModelRunner
from vattn.kv.manager import KVCacheManager
from vattn.kv import make_cache


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(size: int, model, settings: dict, device_type: str = "cpu") -> Group:
    """Rank 0's `Group` of `size` ranks (`model`, `settings`: what every rank
    loads and serves, see `vattn.executor.loader.load` and `EngineConfig`).  Under torchrun a
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
                             f"({'; '.join(f'rank {r}: {text}' for r, text in group.reports().items())})")
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
    try:
        config = EngineConfig(**settings)
        shard, _ = load(model, group.size, config.dtype)
        config = config.for_model(shard)
        cache = make_cache(config.cache_config(shard), config.kv_cache, config.block_size)
        runner = ModelRunner(shard, cache, config.runner_options(sharded=True))
        kv = KVCacheManager(cache, config.enable_prefix_caching)
        replica = Replica(kv)
        dist.barrier()  # loaded: rank 0 waits for every rank here
        while True:
            message = group.receive()
            replica.replay(message.ops)
            if message.inputs is not None:
                runner.run(runner.prepare(message.inputs))
            if message.query == "books":
                group.gather(checked_books(kv))
            elif message.query == "stop":
                runner.close()
                return
    except BaseException as e:
        group.report(e)
        os._exit(1)


def device_type() -> str:
    """Where tensor-parallel ranks run: one GPU each where there are GPUs."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_here(model, group: Group | None, dtype="auto"):
    """(the model, or rank 0's shard of it, in the dtype `dtype` serves, and
    its tokenizer), once every rank of `group` has loaded its own."""
    if group is None:
        return load(model, 1, dtype)
    try:
        loaded = load(model, group.size, dtype)
        dist.barrier()
    except BaseException as e:
        raise group.failure(e) from e
    return loaded


def check_settings(size: int, model, device_type: str) -> None:
    """Refuse a tensor-parallel size before any process starts: it must
    divide the model's heads (read from its config where `model` names one)
    and, on CUDA, not exceed the devices."""
    if device_type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices; "
                         f"{torch.cuda.device_count()} are visible")
    if size > 1 and not callable(model):
        from transformers import AutoConfig

        from vattn.models import BUILT_IN, model_dir

        if model is None or model in BUILT_IN:
            model = model_dir(model)
        check_shardable(AutoConfig.from_pretrained(model), size)


def _threads(size: int) -> int:
    """Each rank's share of this machine's cores."""
    return max(1, (os.cpu_count() or 1) // size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
