"""VMM backends: reserve virtual ranges, own physical pages, map one onto the other."""
import torch

from vattn._native import MapLimitError  # a backend can map no more pages (the process's mapping limit)
from vattn.backends.base import Backend
from vattn.backends.cuda import CudaBackend, CudaUnavailable
from vattn.backends.host import HostBackend


def get_backend(device: str | torch.device = "cpu") -> Backend:
    """The backend that manages memory for `device` ("cpu", "cuda", "cuda:1")."""
    device = torch.device(device)
    if device.type == "cpu":
        return HostBackend()
    if device.type == "cuda":
        return CudaBackend(device)
    raise ValueError(f"no VMM backend for device {str(device)!r}: vattn supports 'cpu' and 'cuda'")


__all__ = ["Backend", "CudaBackend", "CudaUnavailable", "HostBackend", "MapLimitError", "get_backend"]
