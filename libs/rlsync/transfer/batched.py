"""Many GPU copies in one kernel launch: a table of (source, destination, bytes) rows on the device,
one program per row, each row a chunk of at most CHUNK bytes of one copy.

A copy_ per tensor costs a launch (about 10 us of CPU each, 3 ms for a 4B model's 254 large tensors)
and leaves the GPU idle at every kernel's tail; one launch over the whole table runs every copy at
the rate of one (bench/scatter_copy.py, way "table"). The table depends only on the addresses and
sizes, so a pull from held memory into the same destinations builds it once (`table`).

Rows need 16-byte aligned addresses and sizes (the kernel moves 16 bytes at a time); the
caller copies the others itself (`split`). A second kernel casts fp32 to bf16 the same way, its rows
counting elements (`split(cast=True)`: a pull that casts). Without Triton, or off the GPU, nothing is
batched. TRITON_INTERPRET=1 runs the kernels on the CPU (tests/unit/test_batched_copy.py).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

ALIGN = 16  # bytes: addresses and sizes the kernel takes
CHUNK = 1 << 18  # bytes a program copies at most
BLOCK = 2048  # 16-byte pairs of words a program moves per step
WARPS = 4  # the fastest of bench/copy_kernels.py's forms, H200
CAST = (torch.float32, torch.bfloat16)  # the one cast the cast kernel makes (fp32 master weights, bf16 engine)
CAST_CHUNK = 1 << 16  # elements a program casts at most (256 KiB read)
CAST_BLOCK = 1024
CAST_WARPS = 8  # bench/copy_kernels.py, H200: 0.93x of torch's flat cast (4 warps: 0.90x)


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _kernel() is not None


def split(pairs: list[tuple[torch.Tensor, torch.Tensor]], cast: bool = False) -> tuple[np.ndarray, list]:
    """(rows, rest): rows [src address, dst address, bytes] of the (src, dst) uint8 pairs the kernel
    can copy, and the pairs it cannot (an address or a size not a multiple of ALIGN, the two sizes
    unequal, or the ends on different devices). With `cast`, rows [src, dst, elements] of the flat
    (fp32, bf16) pairs the cast kernel takes (addresses multiples of 16 and 8 bytes, elements of 4)."""
    src_align, dst_align, count_align = (16, 8, 4) if cast else (ALIGN, ALIGN, ALIGN)
    rows, rest = [], []
    for src, dst in pairs:
        s, d, n = src.data_ptr(), dst.data_ptr(), src.numel()
        if (s % src_align or d % dst_align or n % count_align or dst.numel() != n or src.device != dst.device
                or (cast and (src.dtype, dst.dtype) != CAST)):
            rest.append((src, dst))
        else:
            rows.append((s, d, n))
    return np.array(rows, dtype=np.int64).reshape(-1, 3), rest


def chunks(rows: np.ndarray, chunk: int, sizes: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Each row cut into rows of at most `chunk` units, in order: [src, dst, units]; a unit is `sizes`
    bytes at the source and at the destination (1 and 1 for a copy's rows, 4 and 2 for a cast's)."""
    counts = (rows[:, 2] + chunk - 1) // chunk
    which = np.repeat(np.arange(len(rows)), counts)
    offsets = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * chunk
    out = rows[which].copy()
    out[:, 0] += offsets * sizes[0]
    out[:, 1] += offsets * sizes[1]
    out[:, 2] = np.minimum(chunk, out[:, 2] - offsets)
    return out


_TABLES: OrderedDict[tuple, Table] = OrderedDict()  # (device, chunk, cast, rows' bytes) -> chunk table there
_TABLES_MAX = 64  # a transfer's buckets each have theirs
_LOCK = threading.Lock()  # senders and receivers run in threads of their own


def table(rows: np.ndarray, device: torch.device, cast: bool = False) -> Table:
    """The chunk table of `rows` (of split(..., cast)) on `device`, made once
    (its upload waits for the stream) and kept while in use; a caller that launches it again and
    again keeps it itself (a held pull's plan)."""
    device = _indexed(device)
    chunk = CAST_CHUNK if cast else CHUNK
    key = (device, chunk, cast, rows.tobytes())
    with _LOCK:
        found = _TABLES.pop(key, None)
        if found is None:
            sizes = (CAST[0].itemsize, CAST[1].itemsize) if cast else (1, 1)
            host = chunks(rows, chunk, sizes)
            found = Table(torch.from_numpy(host).to(device), cast, host)
        _TABLES[key] = found
        while len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return found


class Table(NamedTuple):
    rows: torch.Tensor  # [src, dst, count] per chunk, int64, on the device
    cast: bool  # counts are elements to cast (split(cast=True)), else bytes to copy
    host: np.ndarray  # the same rows, in host memory (rebased)


def rebased(table: Table, old: np.ndarray, new: np.ndarray,
            dst: tuple[np.ndarray, np.ndarray] | None = None) -> Table:
    """`table` with every source moved from the region it read (starting at one of the addresses `old`) to
    the same offset of the region now at the address in `new` of the same index: the same copies out of
    the same layout mapped anew (a trainer's storages after its next onload); `dst`: (old, new) of the
    regions written, moved so too, in the same upload. The regions must be as large as before and
    disjoint. Its upload does not wait for the stream (a copy armed behind a bell may hold it up:
    rlsync.transfer.armed)."""
    moves = [(column, a, b) for column, (a, b) in enumerate([(old, new), dst or (old, old)])
             if not np.array_equal(a, b)]
    if not moves:
        return table
    host = table.host.copy()
    for column, a, b in moves:
        order = np.argsort(a, kind="stable")
        region = order[np.searchsorted(a[order], host[:, column], side="right") - 1]
        host[:, column] += (b - a)[region]
    rows = torch.from_numpy(host)
    if table.rows.device.type == "cuda":  # (pinned: the caching host allocator keeps it until the copy is done)
        rows = rows.pin_memory().to(table.rows.device, non_blocking=True)
    return Table(rows.to(table.rows.device), table.cast, host)


def launch(table: Table) -> None:
    """Queues every copy (or cast) of `table` on the current stream of its device, in one launch. The first
    launch of a kernel on a device goes through Triton (which compiles and loads it); the others straight
    through the driver, holding the GIL (`Launcher`)."""
    rows = table.rows
    if rows.device.type == "cuda":
        stream = torch.cuda.current_stream(rows.device)
        rows.record_stream(stream)  # read there, whoever made it
        launcher = _LAUNCHERS.get(key := (table.cast, rows.device.index))
        if launcher is not None:
            launcher(rows, stream)
            return
    kernel, block, warps = (_kernel().cast_chunks, CAST_BLOCK, CAST_WARPS) if table.cast else \
        (_kernel().copy_chunks, BLOCK, WARPS)
    run = kernel[(rows.shape[0],)]
    if rows.device.type == "cuda":
        with torch.cuda.device(rows.device):
            compiled = run(rows, BLOCK=block, num_warps=warps)
        if key not in _LAUNCHERS:  # (None: Triton launches it, every time)
            _LAUNCHERS[key] = Launcher.of(compiled)
    else:  # only under TRITON_INTERPRET=1
        run(rows, BLOCK=block)


def loaded(table: Table) -> bool:
    """Whether `table`'s kernel was launched on its device before: a launch then loads nothing (a module's load
    may wait for the whole device, which a copy armed behind a bell never lets end: rlsync.transfer.armed)."""
    return (table.cast, table.rows.device.index) in _LAUNCHERS


class Launcher(NamedTuple):
    """A compiled table kernel as the driver launches it: its CUfunction, threads a block, dynamic shared memory,
    and its parameters after the table (Triton's scratch pointers, null where its kernel asks for no scratch)."""
    function: int
    threads: int
    shared: int
    rest: int  # parameters after the table's address
    compiled: object  # Triton's kernel, kept: it unloads its module when it goes

    @staticmethod
    def of(compiled) -> Launcher | None:
        """The launcher of Triton's compiled kernel, or None where it needs more than a table's address and null
        pointers (scratch memory, clusters, cooperative or programmatic launches): Triton launches it."""
        from rlsync.transfer import driver

        meta = compiled.metadata
        if any(getattr(meta, name, 0) for name in ("global_scratch_size", "profile_scratch_size",
                                                   "launch_cooperative_grid", "launch_pdl")) \
                or getattr(meta, "num_ctas", 1) != 1 or not getattr(compiled, "function", None):
            return None
        sizes = driver.param_sizes(compiled.function)
        if not sizes or len(sizes) > 3 or any(size != 8 for size in sizes):  # (the table, Triton's two scratches)
            return None
        return Launcher(compiled.function, 32 * meta.num_warps, meta.shared, len(sizes) - 1, compiled)

    def __call__(self, rows: torch.Tensor, stream: torch.cuda.Stream) -> None:
        from rlsync.transfer import driver

        if not rows.shape[0]:  # (nothing to copy: Triton launches no empty grid either)
            return
        values = (ctypes.c_uint64 * (1 + self.rest))(rows.data_ptr())  # (the rest: zero, null pointers)
        params = (ctypes.c_void_p * (1 + self.rest))(*(ctypes.addressof(values) + 8 * i for i in range(1 + self.rest)))
        driver.launch(self.function, rows.shape[0], self.threads, self.shared, params, stream)


_LAUNCHERS: dict[tuple[bool, int], Launcher | None] = {}  # (cast, device index) -> how the driver launches it


def _indexed(device: torch.device) -> torch.device:
    """`cuda` as the device it means now (`cuda:N`), so tables made under either name are one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def checksum_kernel():
    """batched_kernel.checksum_chunks (rlsync.transfer.checksum.checksum_tensors): where available()."""
    return _kernel().checksum_chunks


@functools.cache
def _kernel():
    """The kernel, built at first use (importing Triton takes a fraction of a second); None without Triton."""
    try:
        from rlsync.transfer import batched_kernel
    except ImportError:
        return None
    return batched_kernel
