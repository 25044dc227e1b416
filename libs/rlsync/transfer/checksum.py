"""A content checksum computed the same way on CPU and GPU, from torch ops only.

Position-weighted (it catches bytes moved to the wrong offset, not just changed ones): with the
bytes read as little-endian 64-bit words w_i (zero-padded), it is (sum w_i, sum (i+1) w_i) modulo
2^64. The weighted sum is computed from row and column sums of a [rows, 1024] view, so no index
tensor as large as the data is ever built. Many tensors at once on a GPU (an audit of a model's
weights): one Triton launch over all of them and one read back (`checksum_tensors`), where a tensor at
a time costs a dozen launches and a synchronization each (~80 ms of a 1.7B model's 310 tensors on an
H200, every decode step of an engine sharing the process held up behind it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from rlsync.transfer import batched

_COLS = 1024
_MASK = (1 << 64) - 1


def _sums(words: torch.Tensor) -> torch.Tensor:
    """[sum w, sum r*w over rows, sum c*w over columns] for int64 words laid out as [rows, _COLS],
    on their device (int64 arithmetic wraps, which is arithmetic modulo 2^64): no synchronization."""
    rows = words.view(-1, _COLS)
    row_sums = rows.sum(dim=1)
    col_sums = rows.sum(dim=0)
    r = torch.arange(rows.shape[0], device=words.device, dtype=torch.int64)
    c = torch.arange(1, _COLS + 1, device=words.device, dtype=torch.int64)
    return torch.stack([row_sums.sum(), (row_sums * r).sum(), (col_sums * c).sum()])


class Checksums:
    """Checksums of byte buffers, computed on their device as they come and read back with a single
    synchronization by `values()`: a per-bucket checksum must not stall a pipelined transfer. The
    buffers may be reused as soon as `add` returns (their kernels are queued on the current stream,
    before any later use of it)."""

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._parts: list[tuple[int, int, torch.Tensor]] = []  # (buffer index, base word, sums)

    def __len__(self) -> int:
        return len(self._sizes)

    def add(self, data: torch.Tensor) -> None:
        """Queues the checksum of a 1-D uint8 tensor (any device)."""
        data = data.reshape(-1)
        if data.storage_offset() % 8:
            data = data.clone()  # an int64 view needs 8-byte alignment
        index, n = len(self._sizes), data.numel()
        self._sizes.append(n)
        block = 8 * _COLS
        main = n - n % block
        if main:
            self._parts.append((index, 0, _sums(data[:main].view(torch.int64))))
        if main < n:
            tail = torch.zeros(block, dtype=torch.uint8, device=data.device)
            tail[: n - main] = data[main:]
            self._parts.append((index, main // 8, _sums(tail.view(torch.int64))))

    def values(self) -> list[str]:
        """Each buffer's checksum, as 'nbytes:s1:s2' in hex, in the order they were added."""
        sums = [[0, 0] for _ in self._sizes]
        by_device: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
        for part in self._parts:
            by_device.setdefault(part[2].device, []).append(part)
        for parts in by_device.values():
            rows = torch.stack([p[2] for p in parts]).tolist()  # the one synchronization
            for (index, base, _), (s1, r, c) in zip(parts, rows):
                acc = sums[index]
                acc[0] += s1
                acc[1] += r * _COLS + c + base * s1
        return [from_sums(n, s1, s2) for n, (s1, s2) in zip(self._sizes, sums)]


def checksum_bytes(data: torch.Tensor) -> str:
    """Checksum of a 1-D uint8 tensor (any device), as 'nbytes:s1:s2' in hex."""
    sums = Checksums()
    sums.add(data)
    return sums.values()[0]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only when `t` is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def checksum_tensor(t: torch.Tensor) -> str:
    return checksum_bytes(as_bytes(t))


def audit_entry(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, checksum) of one tensor: a row of a weight audit (rlsync.common.audit)."""
    return *_row(t), checksum_tensor(t)


def audit(tensors: Mapping[str, torch.Tensor],
          programs: int | None = None) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """{name: audit_entry(tensor)} of many tensors, their checksums taken together (checksum_tensors, at most
    `programs` programs)."""
    return KeptAudit(tensors, programs, once=True)()


class KeptAudit:
    """`audit` of the same named tensors again and again, while they stay where they are (KeptSums): an engine's
    live weights, read back after each commit."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], programs: int | None = None, once: bool = False):
        self.names, self.rows = tuple(tensors), [_row(t) for t in tensors.values()]
        self.sums = KeptSums(list(tensors.values()), programs, once)
        self.tensors = list(tensors.values())  # (kept: what `fits` finds by identity)

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether it audits exactly `tensors`: the same names, each the tensor it was laid out for (a caller's kept
        views: a commit's) or one where that one was, in its shape and dtype (then kept as the one it audits)."""
        if tuple(tensors) != self.names:
            return False
        if all(a is b for a, b in zip(tensors.values(), self.tensors)):
            return True
        if not self.sums.fits(list(tensors.values())):
            return False
        self.tensors = list(tensors.values())
        return True

    def __call__(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        return {n: (*r, c) for n, r, c in zip(self.names, self.rows, self.sums())}


def _row(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


CHUNK_WORDS = 1 << 15  # 64-bit words one program of the checksum kernel sums at most (256 KiB)
SUM_BLOCK = 1024  # words a program loads per step


def checksum_tensors(tensors: Sequence[torch.Tensor], programs: int | None = None) -> list[str]:
    """checksum_tensor of each tensor, in order. On a GPU with Triton, every tensor whose bytes start at
    a multiple of 8 and count a multiple of 8 goes into one kernel launch per device
    (batched_kernel.checksum_chunks) and one read back; the others, and every tensor elsewhere, as
    Checksums takes them (one read back per device for all). The tensors must not change until it returns.
    `programs`: at most that many programs in the launch (a read in the background leaves the other SMs to
    the work beside it); None: a program for each 256 KiB chunk."""
    return KeptSums(tensors, programs, once=True)()


class KeptSums:
    """checksum_tensors of the same tensors again and again, while they stay where they are: laid out once (which
    go in the kernel, its chunk table on each device, the sums it adds into), so that each call is a launch and a
    read back per device with little Python. (An audit in a thread beside an engine that launches its steps from
    Python takes the GIL from it for as long as its Python runs: for a 1.7B model's 310 tensors the layout is
    ~1 ms of it, at every commit.) `once`: for one call (a tensor that is not contiguous is copied into the
    kernel's table); else such a tensor is copied and summed apart at each call."""

    def __init__(self, tensors: Sequence[torch.Tensor], programs: int | None = None, once: bool = False):
        self.count, self.where = len(tensors), None if once else _where(tensors)  # (`fits`: a kept layout's)
        self.rest: list[tuple[int, torch.Tensor]] = []  # summed as Checksums takes them, at each call
        rows: dict[torch.device, list[tuple[int, int, int]]] = {}
        self.kept = []  # the byte views whose addresses the rows hold (a copy of a non-contiguous tensor, once)
        for k, t in enumerate(tensors):
            data = as_bytes(t) if once or t.is_contiguous() else None
            n = data.numel() if data is not None else 0
            if n and not n % 8 and not data.data_ptr() % 8 and batched.available(data.device):
                rows.setdefault(data.device, []).append((data.data_ptr(), n // 8, k))
                self.kept.append(data)
            else:
                self.rest.append((k, data if data is not None and once else t))
        self.launches = [(_ChunkSums(np.array(found, dtype=np.int64), device, programs), [(w, k) for _, w, k in found])
                         for device, found in rows.items()]

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        return _where(tensors) == self.where

    def __call__(self) -> list[str]:
        out: list[str | None] = [None] * self.count
        rest = Checksums()
        for _, t in self.rest:
            rest.add(as_bytes(t))
        for summed, at in self.launches:
            for (words, k), (s1, s2) in zip(at, summed()):
                out[k] = from_sums(8 * words, s1, s2)
        for (k, _), value in zip(self.rest, rest.values()):
            out[k] = value
        return out  # type: ignore[return-value]


def _where(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


class _ChunkSums:
    """The checksum kernel over rows [address, words, index] of one device: its chunk table there, made once;
    each call sums every row's chunks in one launch and reads them back once -> [s1, s2] of each row."""

    def __init__(self, found: np.ndarray, device: torch.device, programs: int | None):
        counts = (found[:, 1] + CHUNK_WORDS - 1) // CHUNK_WORDS
        which = np.repeat(np.arange(len(found)), counts)
        first = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)) * CHUNK_WORDS
        table = np.stack([found[which, 0] + 8 * first, np.minimum(CHUNK_WORDS, found[which, 1] - first),
                          which, first], axis=1)
        self.device, self.chunks = device, len(table)
        # (queued from pinned memory: the caller's stream may hold an engine's step, which a blocking upload
        # would wait for; what reads the table runs after it on that stream, or waits for it there)
        self.table = torch.from_numpy(table).pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else torch.from_numpy(table)
        self.sums = torch.zeros(2 * len(found), dtype=torch.int64, device=device)
        self.programs = min(len(table), programs or len(table))

    def __call__(self) -> list[list[int]]:
        run = batched.checksum_kernel()[(self.programs,)]
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self.sums.zero_()
                run(self.table, self.chunks, self.sums, BLOCK=SUM_BLOCK, num_warps=4)
                summed = torch.cuda.Event()
                summed.record()
            # Waited for here, where the GIL is let go (a read back waits holding it): an audit in a thread beside
            # an engine that launches its steps from Python would stall the engine for the whole kernel otherwise
            summed.synchronize()
        else:  # only under TRITON_INTERPRET=1 (tests/unit/test_checksum.py)
            self.sums.zero_()
            run(self.table, self.chunks, self.sums, BLOCK=SUM_BLOCK)
        return self.sums.view(-1, 2).tolist()


def box_sums(values: torch.Tensor, box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """What a box of a tensor adds to the tensor's checksum sums (s1, s2), its bytes counted at their
    places in the whole tensor: since a word is the sum of its bytes times 256^(place mod 8), the sums
    of a tensor cut into parts are the sums of its parts, modulo 2^64, however it is cut. `values`:
    the box's elements (its shape)."""
    return box_sums_many([(values, box, shape)])[0]


BATCH_BYTES = 64 << 20  # values a BoxSums holds at once (a caller's values may be copies: cast on the way)

NUMPY_WORDS = 1 << 16  # words of stacked boxes on the CPU from which numpy sums them, in a buffer kept (_Group.kept)
Box = tuple[tuple[int, int], ...]


def box_sums_many(boxes: Iterable[tuple[torch.Tensor, Box, tuple[int, ...]]],
                  held_bytes: int = BATCH_BYTES) -> list[tuple[int, int]]:
    """box_sums of each (values, box, shape), all of them held at once. Boxes alike (the same box of tensors of one
    shape and dtype: one expert's slice of each expert) are summed together, stacked: a few operations for all of
    them, where a mixture of experts has hundreds of boxes to sum at every verified update. (BoxSums: the same,
    planned once for boxes summed again and again, their values taken as they come, a batch at a time.)"""
    boxes = list(boxes)
    return BoxSums([(box, shape) for _, box, shape in boxes], held_bytes)(values for values, _, _ in boxes)


class BoxSums:
    """box_sums of each of a fixed list of (box, the tensor's shape), for their values at each call (a rank's share
    of a verified update's checksums, the same boxes while its layout stays). The values are taken from the
    iterable as they come, `held_bytes` of them at most held at once (a caller's values may be copies: cast on the
    way). Which boxes are alike, and where a batch of them ends, are found at the first call and kept: a later
    call only stacks each group's values and sums them (on the CPU, a large group into a buffer kept with the plan).
    Values of another dtype than at the first call are refused (ValueError)."""

    def __init__(self, boxes: Sequence[tuple[Box, tuple[int, ...]]], held_bytes: int = BATCH_BYTES):
        self.boxes, self.held_bytes = boxes, held_bytes
        # per batch: how many boxes, its groups, and where its groups are stacked on the CPU (_group_sums)
        self._batches: list[tuple[int, list[_Group], dict[int, torch.Tensor]]] | None = None

    def __call__(self, values: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
        with torch.no_grad():  # (a trainer's values may be its parameters: no autograd for the stacks)
            if self._batches is None:
                return self._plan(values)
            out, values = [], iter(values)
            for count, groups, buffers in self._batches:
                out += _group_sums(list(itertools.islice(values, count)), groups, buffers)
            return out

    def _plan(self, values: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
        batches, out, start, batch, held = [], [], 0, [], 0
        for k, v in enumerate(itertools.chain(values, [None])):
            if v is not None:
                batch.append(v)
                held += v.numel() * v.element_size()
            if batch and (v is None or held >= self.held_bytes):
                groups = _alike(batch, self.boxes[start:start + len(batch)])
                batches.append((len(batch), groups, {}))
                out += _group_sums(batch, groups, batches[-1][2])
                start, batch, held = k + 1, [], 0
        self._batches = batches
        return out


def share_sums(pieces: Sequence, shapes: Sequence[tuple[int, ...]]) -> BoxSums:
    """The sums of a rank's share of the checksums (routes.share: its pieces, each a box of tensor `p.tensor` of
    those `shapes`), to keep with the pieces."""
    return BoxSums([(p.box, shapes[p.tensor]) for p in pieces])


def tensor_sums(pieces: Sequence, sums: Iterable[tuple[int, int]], tensors: int) -> list[tuple[int, int]]:
    """A rank's share of each of `tensors` tensors' checksum sums: its `pieces`' `sums` (share_sums) added up per
    tensor; the ranks' shares add up to each tensor's sums."""
    out = [(0, 0)] * tensors
    for p, (s1, s2) in zip(pieces, sums):
        out[p.tensor] = (out[p.tensor][0] + s1, out[p.tensor][1] + s2)
    return out


class _Group(NamedTuple):
    """Boxes of a batch summed together: the same box of tensors of one shape, values of one dtype and device."""

    box: Box
    shape: tuple[int, ...]
    dtype: torch.dtype
    which: list[int]  # their places in the batch
    kept: bool = False  # stacked into a buffer kept between calls: several boxes, on the CPU, NUMPY_WORDS or more


def _alike(values: Sequence[torch.Tensor], boxes: Sequence[tuple[Box, tuple[int, ...]]]) -> list[_Group]:
    alike: dict[tuple, list[int]] = {}
    for k, (v, (box, shape)) in enumerate(zip(values, boxes)):
        if v.numel():
            alike.setdefault((v.dtype, v.device, tuple(box), tuple(shape)), []).append(k)
    return [_Group(box, shape, dtype, ks, len(ks) > 1 and device.type == "cpu" and
                   len(ks) * values[ks[0]].numel() * dtype.itemsize >= 8 * NUMPY_WORDS)
            for (dtype, device, box, shape), ks in alike.items()]


def _group_sums(values: Sequence[torch.Tensor], groups: Sequence[_Group],
                buffers: dict[int, torch.Tensor] | None = None) -> list[tuple[int, int]]:
    """box_sums of each of a batch's `values` (an empty box: (0, 0)), group by group. `buffers`: where a group of
    several boxes on the CPU is stacked, kept from one call to the next, by the group's index (a fresh one is paged
    in at every call: 3x the copy)."""
    out = [(0, 0)] * len(values)
    for g, (box, shape, dtype, ks, kept) in enumerate(groups):
        if any(values[k].dtype != dtype for k in ks):  # (a stack would promote or cast them)
            raise ValueError(f"boxes planned as {dtype} came as {sorted({str(values[k].dtype) for k in ks})}: a "
                             "BoxSums sums the boxes it was made for")
        if len(ks) == 1:
            stacked = values[ks[0]].detach().contiguous().unsqueeze(0)  # (one: no copy of it)
        elif kept and buffers is not None:
            buffer = buffers.get(g)
            if buffer is None:
                buffer = buffers[g] = torch.empty((len(ks), *values[ks[0]].shape), dtype=dtype)
            stacked = torch.stack([values[k] for k in ks], out=buffer)
        else:
            stacked = torch.stack([values[k] for k in ks])
        for k, (s1, s2) in zip(ks, _stacked_sums(stacked, box, shape)):
            out[k] = s1 & _MASK, s2 & _MASK
    return out


RUN_WORDS = 1 << 22  # words of runs summed at once (32 MiB, and as many padded where runs start inside a word)


def _runs(box: tuple[tuple[int, int], ...], shape: tuple[int, ...], itemsize: int) -> tuple[np.ndarray, int]:
    """The box as runs of bytes of the whole tensor: where each starts (bytes, in the box's row-major order) and
    their one length. The trailing dimensions the box spans whole continue its last partial one in one run."""
    box = tuple(box) or ((0, 1),)  # (a 0-d tensor: one run of one element)
    shape = tuple(shape) or (1,)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    k = len(box)
    while k > 1 and box[k - 1] == (0, shape[k - 1]):
        k -= 1  # dims k.. are whole: a run reaches over them
    length = (box[k - 1][1] - box[k - 1][0]) * strides[k - 1]
    start = np.zeros((), dtype=np.int64)
    for (a, b), stride in zip(box[:k - 1], strides):
        start = start[..., None] + np.arange(a, b, dtype=np.int64) * stride
    return (start.reshape(-1) + box[k - 1][0] * strides[k - 1]) * itemsize, length * itemsize


@lru_cache(maxsize=4096)
def _run_plan(box: tuple[tuple[int, int], ...], shape: tuple[int, ...], itemsize: int) \
        -> tuple[int, tuple[tuple[int, int, int, np.ndarray | None, np.ndarray], ...]]:
    """How _stacked_sums reads a box, the same at every update of the same tensors: its runs' width, and per
    chunk of RUN_WORDS and start within a word, (first run, count, shift, which runs of the chunk or None for
    all of them, each run's first word). Kept per (box, shape, itemsize): a verified update of a mixture of
    experts sums hundreds of boxes, of a few kinds."""
    start, width = _runs(box, shape, itemsize)
    step, out = max(1, RUN_WORDS // (width // 8 + 2)), []
    for r0 in range(0, len(start), step):
        starts = start[r0:r0 + step]
        shifts = starts % 8
        for shift in np.unique(shifts).tolist():
            at = np.flatnonzero(shifts == shift)
            out.append((r0, len(starts), shift, None if len(at) == len(starts) else at, (starts[at] - shift) // 8))
    return width, tuple(out)


def _stacked_sums(stacked: torch.Tensor, box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> list[list[int]]:
    """[s1, s2] of each of the P boxes `stacked` holds ([P, *the box's shape]), all at the same `box` of a tensor
    of `shape`. The box is runs of bytes of the whole tensor (_runs); runs that start at the same place in a word
    are read as words at once, as _sums reads a tensor, RUN_WORDS at a time (_run_plan). One read back."""
    itemsize, device, count = stacked.element_size(), stacked.device, stacked.shape[0]
    # On the CPU, numpy's integer sums are vectorized where torch's int64 ones are not (2.3x on this project's CPU
    # host; both wrap modulo 2^64); below NUMPY_WORDS its calls cost more than they save.
    numpy_sums = device.type == "cpu" and stacked.numel() * itemsize >= 8 * NUMPY_WORDS
    width, chunks = _run_plan(tuple(box), tuple(shape), itemsize)
    rows = stacked.reshape(count, -1).view(torch.uint8).view(count, -1, width)
    sums = torch.zeros(2, count, dtype=torch.int64, device=device)  # int64 arithmetic wraps: modulo 2^64
    for r0, n, shift, at, first_words in chunks:
        # (every run of the chunk starting at this place in a word: no gather)
        part = rows[:, r0:r0 + n] if at is None else rows[:, r0 + torch.from_numpy(at).to(device)]
        words = -(-(shift + width) // 8)
        if shift == 0 and width % 8 == 0 and part.data_ptr() % 8 == 0 and part.is_contiguous():
            padded = part
        else:  # the runs' bytes at their places in their words, zeros around them
            padded = torch.zeros(count, part.shape[1], words * 8, dtype=torch.uint8, device=device)
            padded[:, :, shift:shift + width] = part
        w = padded.view(torch.int64)
        if numpy_sums:  # (the same arithmetic; numpy's einsum weighs the columns 15x faster than torch's product)
            held = w.numpy()
            row_sums, col_sums = held.sum(axis=2), held.sum(axis=1)
            sums[0] += torch.from_numpy(row_sums.sum(axis=1))
            sums[1] += torch.from_numpy(np.einsum("pr,r->p", row_sums, first_words)
                                        + np.einsum("pw,w->p", col_sums, np.arange(1, words + 1, dtype=np.int64)))
            continue
        row_sums, col_sums = w.sum(dim=2), w.sum(dim=1)
        first = torch.from_numpy(first_words).to(device)  # each run's first word
        places = torch.arange(1, words + 1, device=device, dtype=torch.int64)
        sums[0] += row_sums.sum(dim=1)
        sums[1] += (row_sums * first).sum(dim=1) + (col_sums * places).sum(dim=1)
    return sums.t().tolist()


def from_sums(nbytes: int, s1: int, s2: int) -> str:
    """The checksum string of a tensor of `nbytes` whose sums (added up from its parts) are s1, s2."""
    return f"{nbytes:x}:{s1 & _MASK:016x}:{s2 & _MASK:016x}"
