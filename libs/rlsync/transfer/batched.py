"""Many GPU copies in one kernel launch: a table of (source, destination, bytes) rows on the device,
one program per row, each row a chunk of at most CHUNK bytes of one copy.

A copy_ per tensor costs a launch (about 10 us of CPU each, 3 ms for a 4B model's 254 large tensors)
and leaves the GPU idle at every kernel's tail; one launch over the whole table runs every copy at
the rate of one (bench/scatter_copy.py, way "table"). The table depends only on the addresses and
sizes, so a pull from held memory into the same destinations builds it once (`table`).

Rows need 16-byte aligned addresses and sizes (the kernel moves 16 bytes at a time); the
caller copies the others itself (`split`). Without Triton, or off the GPU, nothing is batched.
TRITON_INTERPRET=1 runs the kernel on the CPU (tests/unit/test_batched_copy.py).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import numpy as np
import torch

ALIGN = 16  # bytes: addresses and sizes the kernel takes
CHUNK = 1 << 18  # bytes a program copies at most
BLOCK = 2048  # 16-byte pairs of words a program moves per step
WARPS = 4  # the fastest of bench/copy_kernels.py's forms, H200


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel() is not None


def split(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[np.ndarray, list]:
    """(rows, rest): rows [src address, dst address, bytes] of the (src, dst) uint8 pairs the kernel
    can copy, and the pairs it cannot (an address or a size not a multiple of ALIGN, the two sizes
    unequal, or the ends on different devices)."""
    rows, rest = [], []
    for src, dst in pairs:
        s, d, n = src.data_ptr(), dst.data_ptr(), src.numel()
        if (s | d | n) % ALIGN or dst.numel() != n or src.device != dst.device:
            rest.append((src, dst))
        else:
            rows.append((s, d, n))
    return np.array(rows, dtype=np.int64).reshape(-1, 3), rest


def chunks(rows: np.ndarray, chunk: int) -> np.ndarray:
    """Each row cut into rows of at most `chunk` bytes, in order: [src, dst, bytes]."""
    counts = (rows[:, 2] + chunk - 1) // chunk
    which = np.repeat(np.arange(len(rows)), counts)
    offsets = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    out = rows[which].copy()
    out[:, 0] += offsets
    out[:, 1] += offsets
    out[:, 2] = np.minimum(chunk, out[:, 2] - offsets)
    return out


_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (device, CHUNK, rows' bytes) -> chunk table there
_TABLES_MAX = 64  # a transfer's buckets each have theirs
_LOCK = threading.Lock()  # senders and receivers run in threads of their own


def table(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """The chunk table of `rows` on `device`, made once (its upload waits for the stream) and kept
    while in use; a caller that launches it again and again keeps it itself (a held pull's plan)."""
    device = _indexed(device)
    key = (device, CHUNK, rows.tobytes())
    with _LOCK:
        found = _TABLES.pop(key, None)
        if found is None:
            found = torch.from_numpy(chunks(rows, CHUNK)).to(device)
        _TABLES[key] = found
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return found


def launch(table: torch.Tensor) -> None:
    """Queues every copy of `table` on the current stream of its device, in one launch."""
    run = _kernel()[(table.shape[0],)]
    if table.device.type == "cuda":
        with torch.cuda.device(table.device):
            table.record_stream(torch.cuda.current_stream(table.device))  # read there, whoever made it
            run(table, BLOCK=BLOCK, num_warps=WARPS)
    else:  # only under TRITON_INTERPRET=1
        run(table, BLOCK=BLOCK)


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the device it means now (`cuda:N`), so tables made under either name are one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _kernel():
    """The kernel, built at first use (importing Triton takes a fraction of a second); None without Triton."""
    try:
        from rlsync.transfer.batched_kernel import copy_chunks
    except ImportError:
        return None
    return copy_chunks
