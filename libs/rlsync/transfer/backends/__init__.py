"""Backend registry: each channel loads on first use, and one that cannot says why."""

from __future__ import annotations

import importlib
import sys
from functools import cache

import torch

from rlsync.errors import FailedPrecondition
from rlsync.transfer.backends.base import Channel
from rlsync.transfer.handshake import NAMES
from rlsync.transfer.v1 import transfer_pb2 as pb

_CHANNELS = {
    pb.BACKEND_SHM: ("rlsync.transfer.backends.slots", "ShmChannel"),
    pb.BACKEND_CUDA_IPC: ("rlsync.transfer.backends.slots", "CudaIpcChannel"),
    pb.BACKEND_GLOO: ("rlsync.transfer.backends.collective", "GlooChannel"),
    pb.BACKEND_NCCL: ("rlsync.transfer.backends.collective", "NcclChannel"),
}


@cache
def _requirement(backend: int) -> str | None:
    """None when this process can run `backend`, else what is missing (asked once: every answer
    needs it, and it does not change while the process lives)."""
    import torch.distributed as dist

    if backend == pb.BACKEND_SHM:
        if not sys.platform.startswith("linux"):
            return "shm needs Linux (memfd and abstract Unix sockets)"
    elif backend == pb.BACKEND_GLOO:
        if not dist.is_available() or not dist.is_gloo_available():
            return "gloo unavailable: this torch build has no gloo backend"
    elif backend == pb.BACKEND_CUDA_IPC:
        if not torch.cuda.is_available():
            return "cuda_ipc unavailable: no CUDA device"
    elif backend == pb.BACKEND_NCCL:
        if not torch.cuda.is_available():
            return "nccl unavailable: no CUDA device"
        if not dist.is_nccl_available():
            return "nccl unavailable: this torch build has no NCCL"
    return None


def unavailable() -> dict[int, str]:
    """Backends this process cannot run, with the reason for each."""
    return {b: why for b in _CHANNELS if (why := _requirement(b))}


def available() -> set[int]:
    return set(_CHANNELS) - set(unavailable())


_loaded: dict[int, Channel] = {}


def channel(backend: int) -> Channel:
    if backend in _loaded:
        return _loaded[backend]
    if backend not in _CHANNELS:
        raise FailedPrecondition(f"unknown backend {backend}")
    why = _requirement(backend)
    if why:
        raise FailedPrecondition(why)
    module, cls = _CHANNELS[backend]
    try:
        _loaded[backend] = getattr(importlib.import_module(module), cls)()
    except ImportError as e:
        raise FailedPrecondition(f"{NAMES[backend]} unavailable: {e}") from e
    return _loaded[backend]
