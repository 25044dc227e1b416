"""Routing, pure: which trainer rank sends which slice of which tensor to which engine ranks.

Both sides describe a layout: for every rank, the boxes of each tensor it holds (a trainer rank:
its shard, or the whole tensor when replicated) or loads (an engine rank: its tensor-parallel slice,
or the whole tensor). A box is a [start, stop) range per dimension of the whole tensor. The plan cuts
each tensor along every box edge of both sides; each cell goes from one trainer rank that holds it
(the least loaded so far, so replicated tensors are spread) to every engine rank that loads it. Cells
with the same sender, the same receivers and from the same box of the sender are merged back into
boxes (pieces); a receiver then takes every piece one sender sends it in one transfer, so every pair
of ranks moves its bytes in one stream of buckets. A transfer is one sender, its pieces (in tensor
order), and the receivers that take exactly those pieces from it (the same tensor-parallel rank of
several replicas: packed once, sent to each). Grouping cells by their set of receivers instead gave
an engine rank two streams from one sender wherever a part of a tensor it loads alone sat beside one
others load too (an expert split by tensor parallelism beside a replicated norm), each bucket a
message more.

Every byte an engine rank loads comes from exactly one trainer rank, once; a trainer rank sends a
byte it alone holds at most once to each engine rank that loads it. Like bucket planning, the plan is
computed once per pair of layouts (`cached_routes`) and never travels: both sides compute it.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import chain, product

from rlsync.errors import InvalidArgument

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension; () is a 0-dim tensor


def whole(shape: Sequence[int]) -> Box:
    """The box of all of a tensor of `shape` (kept: a receiver cuts one per tensor at every update)."""
    return _whole(tuple(shape))


@lru_cache(maxsize=4096)
def _whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, int(d)) for d in shape)


def row_major_strides(shape: Sequence[int]) -> list[int]:
    """The elements each dimension steps over in a contiguous tensor of `shape`."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def extent(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def chunks(size: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `n` parts of `size`, as torch.chunk and DTensor's Shard split a
    dimension: parts of ceil(size / n), the last ones shorter or empty."""
    return [chunk(size, n, i) for i in range(n)]


def chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """Part `i` of chunks(size, n)."""
    step = -(-size // n) if size else 0
    return min(i * step, size), min((i + 1) * step, size)


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def relative(inner: Box, outer: Box) -> Box:
    """`inner` in the coordinates of `outer` (which contains it)."""
    return tuple((i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class Layout:
    """`held[rank][tensor]`: the boxes of tensor `tensor` (an index into `tensors`) that `rank` holds."""

    tensors: tuple[TensorInfo, ...]
    held: tuple[tuple[tuple[Box, ...], ...], ...]

    def __hash__(self) -> int:
        """Hashed once (cached_routes looks both layouts up at every transfer: at 256 ranks of ~300
        tensors, hashing one afresh takes 4 ms)."""
        if (h := self.__dict__.get("_hash")) is None:
            h = hash((self.tensors, self.held))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def ranks(self) -> int:
        return len(self.held)

    def nbytes(self, rank: int) -> int:
        """Bytes `rank` holds (a box held twice counts twice)."""
        return sum(volume(b) * t.itemsize for t, boxes in zip(self.tensors, self.held[rank]) for b in boxes)


def layout(tensors: Sequence[TensorInfo], held: Sequence[Sequence[Sequence[Box]]]) -> Layout:
    """A checked Layout: every rank says something (maybe nothing) of every tensor, boxes lie inside it."""
    tensors = tuple(tensors)
    wholes = [whole(t.shape) for t in tensors]
    held = list(held)  # every rank's boxes alive till the end: the memo below goes by their ids
    out, checked = [], {}  # ranks given the same list (replicas' ranks, read once) are checked once
    for rank, boxes in enumerate(held):
        if (done := checked.get(id(boxes))) is not None:
            out.append(done)
            continue
        if len(boxes) != len(tensors):
            raise InvalidArgument(f"rank {rank} describes {len(boxes)} tensors, the layout has {len(tensors)}")
        for t, shape_box, tensor_boxes in zip(tensors, wholes, boxes):
            for b in tensor_boxes:
                if len(b) != len(t.shape) or not contains(shape_box, b) or any(s > e for s, e in b):
                    raise InvalidArgument(f"rank {rank}: box {list(map(list, b))} is not inside {t.name!r} of shape "
                                          f"{list(t.shape)}")
        out.append(tuple(tuple(tuple(map(tuple, b)) for b in tensor_boxes if volume(b) or not b)
                         for tensor_boxes in boxes))
        checked[id(boxes)] = out[-1]
    return Layout(tensors, tuple(out))


@dataclass(frozen=True)
class Piece:
    tensor: int  # index into the layouts' tensors
    box: Box  # in the whole tensor's coordinates; its bytes travel packed, row-major

    def nbytes(self, tensors: Sequence[TensorInfo]) -> int:
        return volume(self.box) * tensors[self.tensor].itemsize


@dataclass(frozen=True)
class Transfer:
    src: int  # trainer rank
    dsts: tuple[int, ...]  # the engine ranks that each receive every piece, and nothing else from src
    pieces: tuple[Piece, ...]  # in tensor order (both ends derive the same order)


@dataclass(frozen=True)
class Routes:
    tensors: tuple[TensorInfo, ...]
    transfers: tuple[Transfer, ...]
    senders: int
    receivers: int

    def __hash__(self) -> int:
        """Hashed once, as Layout: what a transfer derives from its routes (its schedule, its bytes) is
        kept by them, and a repeat update meets the very same Routes again (pulls.split)."""
        if (h := self.__dict__.get("_hash")) is None:
            h = hash((self.tensors, self.transfers, self.senders, self.receivers))
            object.__setattr__(self, "_hash", h)
        return h

    def sent_bytes(self) -> list[int]:
        """Per trainer rank: the payload it sends (a byte several engine ranks load, once to each)."""
        out = [0] * self.senders
        for t in self.transfers:
            out[t.src] += sum(p.nbytes(self.tensors) for p in t.pieces) * len(t.dsts)
        return out

    def received_bytes(self) -> list[int]:
        out = [0] * self.receivers
        for t in self.transfers:
            size = sum(p.nbytes(self.tensors) for p in t.pieces)
            for d in t.dsts:
                out[d] += size
        return out

    def of_sender(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def of_receiver(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if rank in t.dsts]

    def only(self, keep: Callable[[int, int], bool]) -> Routes:
        """The same transfers, each to the receivers `keep(src, dst)` picks (in the same places, so a
        transfer's index means the same in both; one left with no receiver moves nothing)."""
        return replace(self, transfers=tuple(Transfer(t.src, tuple(d for d in t.dsts if keep(t.src, d)), t.pieces)
                                             for t in self.transfers))


def plan_routes(trainer: Layout, engine: Layout) -> Routes:
    """Pairs every box an engine rank loads with the trainer ranks that hold it (see the module doc).
    Refuses layouts of different tensors, and a box an engine rank loads that no trainer rank holds."""
    _check_same_tensors(trainer.tensors, engine.tensors)
    load = [0] * trainer.ranks
    groups: dict[tuple[int, tuple[int, ...]], list[Piece]] = defaultdict(list)
    for index, info in enumerate(trainer.tensors):
        holders = _ranks_by_box(trainer, index)
        needers = _ranks_by_box(engine, index)
        if not needers:
            continue
        # (sender, receivers, the sender's box it comes from) -> cells: a piece never spans two boxes
        # of its sender (two parts of a fused tensor lie in two tensors there).
        cells: dict[tuple[int, tuple[int, ...], Box], list[Box]] = defaultdict(list)
        grid = _Grid(info.shape, [*holders, *needers])
        wanted = grid.covering(needers)
        owning = grid.covering(holders)
        for key in sorted(wanted):
            cell = grid.cell(key)
            boxes = wanted[key]
            dsts = needers[boxes[0]] if len(boxes) == 1 else tuple(sorted({r for b in boxes for r in needers[b]}))
            owners = owning.get(key)
            if not owners:
                raise InvalidArgument(f"no trainer rank holds {info.name!r}{list(map(list, cell))}, which engine rank "
                                      f"{dsts[0]} loads: the trainer's layout does not cover the tensor")
            src, held = min(((r, b) for b in owners for r in holders[b]),  # ties: the rank's own box order
                            key=lambda o: (load[o[0]], o[0], trainer.held[o[0]][index].index(o[1])))
            load[src] += volume(cell) * info.itemsize
            cells[(src, dsts, held)].append(cell)
        for (src, dsts, _), boxes in sorted(cells.items()):
            groups[(src, dsts)].extend(Piece(index, b) for b in _merge(boxes))
    return Routes(trainer.tensors, _per_receiver(groups), trainer.ranks, engine.ranks)


def _per_receiver(groups: Mapping[tuple[int, tuple[int, ...]], list[Piece]]) -> tuple[Transfer, ...]:
    """Pieces grouped by (sender, set of receivers) regrouped as transfers: a receiver takes every group of the
    sender that names it in one transfer, shared by the receivers that take the same groups."""
    taken: dict[tuple[int, int], list[tuple[int, ...]]] = defaultdict(list)  # (sender, receiver) -> its groups
    for src, dsts in sorted(groups):
        for dst in dsts:
            taken[(src, dst)].append(dsts)
    sharing: dict[tuple[int, tuple], list[int]] = defaultdict(list)
    for (src, dst), sets in sorted(taken.items()):
        sharing[(src, tuple(sets))].append(dst)
    transfers = []
    for (src, sets), dsts in sorted(sharing.items()):
        pieces = chain.from_iterable(groups[(src, s)] for s in sets)  # (each group in tensor order already)
        ordered = sorted(pieces, key=_piece_order) if len(sets) > 1 else pieces
        transfers.append(Transfer(src, tuple(dsts), tuple(ordered)))
    return tuple(transfers)


def _piece_order(p: Piece) -> tuple:
    return p.tensor, p.box


@lru_cache(maxsize=16)
def cached_routes(trainer: Layout, engine: Layout) -> Routes:
    """plan_routes, remembered: the same layouts meet again at every update."""
    return plan_routes(trainer, engine)


@lru_cache(maxsize=16)
def share(held: Layout, rank: int) -> tuple[Piece, ...]:
    """The pieces `rank` covers when each tensor is split once among the ranks that hold it (routes to
    one whole copy; a box several ranks hold counts once): what its share of a checksum is summed over.
    Remembered, as cached_routes is: a verified update asks again for the layout it kept."""
    one = layout(held.tensors, [[[whole(t.shape)] if volume(whole(t.shape)) else [] for t in held.tensors]])
    return tuple(p for transfer in cached_routes(held, one).of_sender(rank) for p in transfer.pieces)


def _check_same_tensors(a: Sequence[TensorInfo], b: Sequence[TensorInfo]) -> None:
    if tuple(a) == tuple(b):
        return
    problems = []
    mine = {t.name: t for t in a}
    theirs = {t.name: t for t in b}
    for name in sorted(set(mine) ^ set(theirs)):
        problems.append(f"{name!r} only on the {'trainer' if name in mine else 'engine'}")
    for name in sorted(set(mine) & set(theirs)):
        if mine[name] != theirs[name]:
            problems.append(f"{name!r} is {list(mine[name].shape)} x {mine[name].itemsize} B on the trainer, "
                            f"{list(theirs[name].shape)} x {theirs[name].itemsize} B on the engine")
    if not problems:
        problems.append("the tensors are in another order")
    raise InvalidArgument("the trainer's and the engine's layouts describe different tensors: "
                          + "; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


def _ranks_by_box(held: Layout, index: int) -> dict[Box, tuple[int, ...]]:
    """Each distinct box of tensor `index`, with the ranks that hold it (in rank order): the replicas of
    a fleet load the same boxes, as the replicas of an HSDP mesh hold them, so the boxes are few where
    the ranks are many."""
    out: dict[Box, list[int]] = defaultdict(list)
    for rank, boxes in enumerate(held.held):
        for box in boxes[index]:
            if not out[box] or out[box][-1] != rank:
                out[box].append(rank)
    return {box: tuple(ranks) for box, ranks in out.items()}


class _Grid:
    """The grid every box edge cuts a tensor into, indexed: a cell is a tuple of interval indices, one
    per dimension, and each box covers a block of them (found by bisection), so finding who holds or
    loads each cell costs the cells each box covers, not cells times boxes."""

    def __init__(self, shape: tuple[int, ...], boxes: list[Box]):
        self.edges = [sorted({0, size, *(b[d][0] for b in boxes), *(b[d][1] for b in boxes)})
                      for d, size in enumerate(shape)]

    def covering(self, boxes: Iterable[Box]) -> dict[tuple[int, ...], list[Box]]:
        """cell key -> every box that covers the cell (cells of no volume left out)."""
        out: dict[tuple[int, ...], list[Box]] = defaultdict(list)
        for box in boxes:
            ranges = [range(bisect_left(e, a), bisect_left(e, b)) for e, (a, b) in zip(self.edges, box)]
            for key in product(*ranges):
                out[key].append(box)
        return out

    def cell(self, key: tuple[int, ...]) -> Box:
        return tuple((e[i], e[i + 1]) for e, i in zip(self.edges, key))


def _merge(boxes: list[Box]) -> list[Box]:
    """Joins boxes that touch along one dimension and match in all others, until none do."""
    boxes = sorted(boxes)
    merged = True
    while merged and len(boxes) > 1:
        merged = False
        for dim in reversed(range(len(boxes[0]))):
            by_rest: dict[tuple, list[Box]] = defaultdict(list)
            for b in boxes:
                by_rest[b[:dim] + b[dim + 1:]].append(b)
            out = []
            for run in by_rest.values():
                run.sort(key=lambda b: b[dim][0])
                current = run[0]
                for b in run[1:]:
                    if b[dim][0] == current[dim][1]:
                        current = current[:dim] + ((current[dim][0], b[dim][1]),) + current[dim + 1:]
                        merged = True
                    else:
                        out.append(current)
                        current = b
                out.append(current)
            boxes = sorted(out)
    return boxes
