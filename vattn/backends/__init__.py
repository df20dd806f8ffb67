"""VMM backends: reserve virtual ranges, own physical pages, map one onto the other."""
import threading

import torch

from vattn.binding import MapLimitError  # a backend can map no more pages (the process's mapping limit)
from vattn.backends.base import Backend
from vattn.backends.cuda import CudaBackend, CudaUnavailable
from vattn.backends.host import HostBackend


_backends: dict[torch.device, Backend] = {}
_lock = threading.Lock()


def get_backend(device: str | torch.device = "cpu") -> Backend:
    """The backend that manages memory for `device` ("cpu", "cuda", "cuda:1"):
    one per device, made at the first call and shared by every cache on it (a
    CUDA backend holds the device's primary context and the streams its
    unmaps wait for)."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no VMM backend for device {str(device)!r}: vattn supports 'cpu' and 'cuda'")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _backends:
            _backends[device] = HostBackend() if device.type == "cpu" else CudaBackend(device)
        return _backends[device]


__all__ = ["Backend", "CudaBackend", "CudaUnavailable", "HostBackend", "MapLimitError", "get_backend"]
