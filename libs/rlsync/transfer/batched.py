"""Many GPU copies in one kernel launch: a table of (source, destination, bytes) rows on the device,
one program per row, each row a chunk of at most CHUNK bytes of one copy.

A copy_ per tensor costs a launch (about 10 us of CPU each, 3 ms for a 4B model's 254 large tensors)
and leaves the GPU idle at every kernel's tail; one launch over the whole table runs every copy at
the rate of one (bench/scatter_copy.py, way "table"). The table depends only on the addresses and
sizes, so a pull from held memory into the same destinations builds it once (`_TABLES`).

Rows need 16-byte aligned addresses and sizes (the kernel moves 16 bytes at a time); the
caller copies the others itself (`split`). Without Triton, or off the GPU, nothing is batched.
TRITON_INTERPRET=1 runs the kernel on the CPU (tests/unit/test_batched_copy.py).
"""

from __future__ import annotations

import functools
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
    can copy, and the pairs it cannot (an address or a size not a multiple of ALIGN, or the source on
    another device)."""
    rows, rest = [], []
    for src, dst in pairs:
        s, d, n = src.data_ptr(), dst.data_ptr(), src.numel()
        if (s | d | n) % ALIGN or src.device != dst.device:
            rest.append((src, dst))
        else:
            rows.append((s, d, n))
    return np.array(rows, dtype=np.int64).reshape(-1, 3), rest


def chunks(rows: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """Each row cut into rows of at most `chunk` bytes, in order: [src, dst, bytes]."""
    counts = (rows[:, 2] + chunk - 1) // chunk
    which = np.repeat(np.arange(len(rows)), counts)
    offsets = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    out = rows[which].copy()
    out[:, 0] += offsets
    out[:, 1] += offsets
    out[:, 2] = np.minimum(chunk, out[:, 2] - offsets)
    return out


_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (CHUNK, rows' bytes) -> the chunk table on the device
_TABLES_MAX = 64  # a transfer's buckets each have theirs


def copy_rows(rows: np.ndarray, device: torch.device) -> None:
    """Queues every copy `rows` describes on the current stream, in one launch."""
    if not len(rows):
        return
    key = (CHUNK, rows.tobytes())
    table = _TABLES.get(key)
    if table is None or table.device != device:
        table = torch.from_numpy(chunks(rows)).to(device)  # waits for the stream: once per layout
        _TABLES[key] = table
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    _TABLES.move_to_end(key)
    launch = _kernel()[(table.shape[0],)]
    if device.type == "cuda":
        with torch.cuda.device(device):
            launch(table, BLOCK=BLOCK, num_warps=WARPS)
    else:  # only under TRITON_INTERPRET=1
        launch(table, BLOCK=BLOCK)


@functools.cache
def _kernel():
    """The kernel, built at first use (importing Triton takes a fraction of a second); None without Triton."""
    try:
        from rlsync.transfer.batched_kernel import copy_chunks
    except ImportError:
        return None
    return copy_chunks
