"""Memory that another process can map: CPU buffers backed by memfd (handed over as file
descriptors, so nothing has a name and nothing can leak), and CUDA storages shared by IPC handle."""

from __future__ import annotations

import mmap
import os

import torch

from rlsync.errors import Unmappable
from rlsync.transfer.v1 import transfer_pb2 as pb


class SharedBuffer:
    """A CPU byte buffer in anonymous shared memory (memfd)."""

    def __init__(self, nbytes: int, fd: int | None = None):
        self.nbytes = nbytes
        own = fd is None
        if own:
            fd = os.memfd_create("rlsync", os.MFD_CLOEXEC)
            os.ftruncate(fd, max(nbytes, 1))
        try:
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            if not own:  # a mapping outlives its descriptor: an attached one closes its own now, mapped or not
                os.close(fd)
        self.fd = fd if own else None
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> SharedBuffer:
        return cls(nbytes, fd)

    def close(self) -> None:
        self.tensor = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self._map.close()
        except BufferError:
            pass  # views still alive; the mapping goes when they do


class SharedArena:
    """Allocates tensors in shared memory, so a same-host receiver can copy straight out of them
    (shm one-copy). The trainer keeps its parameters here when it publishes over shm.

    Tensors are carved out of large chunks (few descriptors to hand over, few mappings)."""

    ALIGN = 256

    def __init__(self, chunk_bytes: int = 1 << 30):
        self.chunk_bytes = chunk_bytes
        self.buffers: list[SharedBuffer] = []
        self._used = 0  # bytes used in the last buffer

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if size == 0:
            return torch.empty(0, dtype=dtype)
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if not self.buffers or start + size > self.buffers[-1].nbytes:
            self.buffers.append(SharedBuffer(max(size, self.chunk_bytes)))
            start = 0
        self._used = start + size
        return self.buffers[-1].tensor[start:start + size].view(dtype)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(buffer index, byte offset) of a contiguous CPU tensor inside the arena, else None."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        for i, buf in enumerate(self.buffers):
            base = buf.tensor.data_ptr()
            if base <= ptr and ptr + size <= base + buf.nbytes:
                return i, ptr - base
        return None

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()


def export_cuda(t: torch.Tensor) -> pb.CudaIpcHandle:
    """The IPC handle of the storage under a CUDA tensor (as torch.multiprocessing shares it)."""
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = t.untyped_storage()._share_cuda_()
    return pb.CudaIpcHandle(device=device, handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event or b"",
                            event_sync_required=event_sync)


def import_cuda(h: pb.CudaIpcHandle, device: torch.device) -> torch.Tensor:
    """Maps another process's CUDA storage on `device` (the same GPU, possibly under another
    index in this process); returns its bytes as a flat uint8 tensor."""
    torch.cuda.init()  # _new_shared_cuda does not: in a process that has not used CUDA yet it crashes
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index if device.index is not None else torch.cuda.current_device(), h.handle,
            h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle or None, h.event_sync_required)
    except RuntimeError as e:  # cudaIpcOpenMemHandle's refusal: nothing of the sender's was read
        raise Unmappable(f"cannot map the sender's CUDA memory on {device}: {e} (is it on another GPU, or in a "
                         "container without IPC to this one? --ipc=host on both)") from e
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def open_cuda(raw: bytes, device: torch.device) -> torch.Tensor:
    """import_cuda of a serialized handle. Mappings are not cached: while a receiver maps a storage
    the sender cannot free it (torch keeps shared memory alive for its consumers), and a trainer
    that offloads must be able to."""
    h = pb.CudaIpcHandle()
    h.ParseFromString(raw)
    return import_cuda(h, device)


def share_cuda(t: torch.Tensor, cache: dict) -> bytes:
    """The serialized handle of t's storage, exported once per storage (the cache keeps the
    storage alive, so its address cannot be reused by another allocation meanwhile)."""
    storage = t.untyped_storage()
    key = ("ipc", storage.data_ptr(), storage.nbytes())
    if key not in cache:
        cache[key] = (storage, export_cuda(t).SerializeToString())
    return cache[key][1]
