"""`vattn info`: what vattn finds on this machine, and how it would lay out memory here."""
import os
import platform

from vattn import allocator


def run() -> None:
    import torch

    import vattn
    from vattn.backends import get_backend
    from vattn.backends.cuda import unavailable
    from vattn.report import print_table
    from vattn.config import DEFAULTS
    from vattn.executor.paths import kernel_paths
    from vattn.kv.shared import CHUNK_SIZE

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
        ["shared KV pool (several models)", f"chunks of {_size(CHUNK_SIZE)}, each holding whole pages of one "
                                            "model; the split: vattn serve's GET /v1/kv_pool, /metrics, the demo"],
        ["vm.max_map_count", max_maps],
        ["mappings in this process", maps_now],
        ["torch", torch.__version__],
        ["CUDA available to torch", torch.cuda.is_available()],
        ["python", platform.python_version()],
        ["CPUs", os.cpu_count()],
        ["memory allocator", allocator.name()],
        *([name, path] for name, path in kernel_paths()),
    ])


def _distributed() -> str:
    """What `tensor_parallel_size` > 1 runs on here."""
    import torch.distributed as dist

    from vattn.distributed import ranks
    from vattn.distributed.group import backend

    if not dist.is_available():
        return "unavailable: torch was built without torch.distributed"
    backends = "gloo" + (", nccl" if dist.is_nccl_available() else "")
    where = ranks.device_type()
    launch = ("torchrun (RANK, WORLD_SIZE set): every process one rank" if ranks.launched_by_torchrun()
              else "ranks spawned on this machine, or torchrun across machines")
    return f"torch.distributed ({backends}): ranks on {where} over {backend(where)}; {launch}"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
