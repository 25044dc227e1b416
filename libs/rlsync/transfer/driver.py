"""Calls into the CUDA driver: the stream memory operations torch does not expose, and the few
calls a replica makes beside its decode loop that must not let go of the GIL.

torch's bindings let go of the GIL around each call into CUDA. Beside a thread that holds it most of
the time (an engine's decode loop, which takes it back after every kernel it launches) each such
call then waits to take it again. What is queued here is queued holding it (`ctypes.PyDLL`): a
replica's launch of its copy and the copy's event took 0.26–0.30 ms this way beside decoding on an
H200 (its checks included), 0.38–0.44 ms through torch. Only calls that return once queued belong
here. One may wait inside the driver (on its locks, on a stream's full queue, for a device's primary
context made at the first call) and every Python thread waits with it, but never on Python: nothing
here can deadlock with a thread that waits for the GIL.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from functools import cache

import torch

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_FENCED = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: what the stream wrote before is visible first
_HOST_PORTABLE_MAPPED = 0x1 | 0x2  # CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP
_NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy default stream
_P, _U64, _U32, _INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int


@cache
def _call(name: str, *argtypes):
    """The driver's entry point `name` (its _v2 where there is one), typed, called holding the GIL."""
    lib = ctypes.PyDLL("libcuda.so.1")
    fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int

    def call(*args) -> None:
        if rc := fn(*args):
            raise RuntimeError(f"{name} failed (CUresult {rc})")
    return call


@cache
def _primary(index: int) -> int:
    """Device `index`'s primary context: the one torch works in."""
    device, context = _INT(), _P()
    _call("cuDeviceGet", ctypes.POINTER(_INT), _INT)(ctypes.byref(device), index)
    _call("cuDevicePrimaryCtxRetain", ctypes.POINTER(_P), _INT)(ctypes.byref(context), device)
    return context.value


@contextmanager
def _primary_current(index: int):
    """Device `index`'s primary context current for the block only: a thread that has not called into CUDA
    has none, and one may have another device's current, which it keeps."""
    context, wanted = _P(), _primary(index)
    _call("cuCtxGetCurrent", ctypes.POINTER(_P))(ctypes.byref(context))
    switched = context.value != wanted
    if switched:
        _call("cuCtxSetCurrent", _P)(wanted)
    try:
        yield
    finally:
        if switched:
            _call("cuCtxSetCurrent", _P)(context)


def _queue_on(stream: torch.cuda.Stream, name: str, argtypes: tuple, *args) -> None:
    """Calls `name` (it queues work on `stream`, passed last) in the primary context of the stream's device."""
    with _primary_current(stream.device.index):
        _call(name, *argtypes, _P)(*args, stream.cuda_stream)


def new_stream(index: int) -> int:
    """A stream created for the caller alone on device `index` (non-blocking, in its primary context) -> its CUstream.
    torch's `Stream()` hands out the streams of a pool of 32 in turn: every 32nd taker, NCCL's groups among them,
    gets the same one, and its work would queue behind a wait on it (a bell's)."""
    stream = _P()
    with _primary_current(index):
        _call("cuStreamCreate", ctypes.POINTER(_P), ctypes.c_uint)(ctypes.byref(stream), _NON_BLOCKING)
    return stream.value


def copy(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Queues dst's bytes := src's on `stream`, a copy of bytes (no dtype conversion): what
    `dst.copy_(src, non_blocking=True)` queues for two contiguous CUDA tensors of one size and dtype
    (`src` may be memory mapped from another process)."""
    nbytes = dst.numel() * dst.element_size()
    if not (dst.is_cuda and src.is_cuda and dst.device == src.device == stream.device):
        raise ValueError(f"a copy on the GPU needs both tensors on the stream's device {stream.device}, "
                         f"got {dst.device} and {src.device}")
    if not (dst.is_contiguous() and src.is_contiguous() and src.numel() * src.element_size() == nbytes):
        raise ValueError(f"a copy of bytes needs two contiguous tensors of one size, got {dst.shape} and {src.shape}")
    _queue_on(stream, "cuMemcpyDtoDAsync", (_U64, _U64, ctypes.c_size_t), dst.data_ptr(), src.data_ptr(), nbytes)


def copy_at(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Queues a copy of `nbytes` from address `src` to `dst` on `stream`, wherever the device maps them (its
    memory, or host memory registered for it: cuMemcpyAsync, unified addressing)."""
    _queue_on(stream, "cuMemcpyAsync", (_U64, _U64, ctypes.c_size_t), dst, src, nbytes)


def record(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """Records `event` (created on the stream's device: an interprocess one once its handle was
    taken) after what `stream` holds now."""
    if not event.cuda_event:
        raise ValueError("the event is not created yet (torch creates one at its first record)")
    _queue_on(stream, "cuEventRecord", (_P,), event.cuda_event)


def wait_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queues on `stream` a wait until the 4-byte word at `address` is >= `value`
    (cuStreamWaitValue32)."""
    with _primary_current(stream.device.index):  # (the legacy default stream is the current context's)
        _call("cuStreamWaitValue32", _P, _U64, _U32, ctypes.c_uint)(stream.cuda_stream, address, value, _WAIT_GEQ)


def write_value(stream: torch.cuda.Stream, address: int, value: int) -> None:
    """Queues on `stream` a write of `value` into the 4-byte word at `address`, after what the stream
    wrote before is visible (cuStreamWriteValue32), in the primary context of the stream's device (a thread that
    only mapped host memory has none current: the legacy default stream needs one)."""
    with _primary_current(stream.device.index):
        _call("cuStreamWriteValue32", _P, _U64, _U32, ctypes.c_uint)(stream.cuda_stream, address, value,
                                                                     _WRITE_FENCED)


def register_host(address: int, nbytes: int, index: int) -> int:
    """Page-locks `nbytes` of this process's memory at `address` (a page of it, mapped for every device:
    cuMemHostRegister, portable and device-mapped) -> the address device `index` reads and writes it at."""
    with _primary_current(index):
        _call("cuMemHostRegister", _P, ctypes.c_size_t, ctypes.c_uint)(address, nbytes, _HOST_PORTABLE_MAPPED)
        mapped = _U64()
        _call("cuMemHostGetDevicePointer", ctypes.POINTER(_U64), _P, ctypes.c_uint)(ctypes.byref(mapped), address, 0)
    return mapped.value


def unregister_host(address: int, index: int) -> None:
    """Undoes `register_host`."""
    with _primary_current(index):
        _call("cuMemHostUnregister", _P)(address)


def param_sizes(function: int) -> list[int] | None:
    """The byte size of each parameter of the kernel `function` (a CUfunction), in order, or None where the
    driver cannot say (cuFuncGetParamInfo: CUDA 12.4 on)."""
    try:
        info = _call("cuFuncGetParamInfo", _P, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                     ctypes.POINTER(ctypes.c_size_t))
    except AttributeError:  # an older driver
        return None
    sizes, offset, size = [], ctypes.c_size_t(), ctypes.c_size_t()
    while len(sizes) < 64:
        try:
            info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size))
        except RuntimeError:  # CUDA_ERROR_INVALID_VALUE past the last one
            return sizes
        sizes.append(size.value)
    return None


def launch(function: int, grid: int, threads: int, shared: int, params: ctypes.Array, stream: torch.cuda.Stream) \
        -> None:
    """Queues the kernel `function` (a CUfunction loaded in the primary context of the stream's device) on
    `stream`: `grid` blocks of `threads`, `shared` bytes of dynamic shared memory, `params` a pointer to each
    argument's value (cuLaunchKernel). Holding the GIL: ~10 us, where a launch through Triton's Python beside
    a busy engine waited for the GIL at each of its CUDA calls."""
    with _primary_current(stream.device.index):
        _call("cuLaunchKernel", _P, *(ctypes.c_uint,) * 7, _P, _P, _P)(
            function, grid, 1, 1, threads, 1, 1, shared, stream.cuda_stream, ctypes.cast(params, _P), None)

