"""A trainer rank's share of the engine's tensors: which boxes of each it holds (its routing layout),
and each piece a route asks of it, cut from its local shards with no collective.

DTensor placements give the boxes (Shard(d) split as torch.chunk splits, Replicate whole, several
mesh dimensions applied in order, as DTensor does); a plain tensor is held whole by every rank
(one process, or a replicated module under DDP). A fused engine tensor (WeightMap.fuse) is its
parts' boxes, each moved down dim 0 by the rows of the parts before it. An expert's tensor of a fused
experts parameter (Entry.view) is what a rank's box of that parameter holds of the expert's rows: under
FSDP2's Shard(0) a rank holds whole experts and nothing of the others. A stacked one (Stacked) is the rank's box
of the parameter, stacked.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from rlsync.errors import InvalidArgument
from rlsync.checkpoint_names import Stacked, View
from rlsync.publish.mapping import Entry
from rlsync.transfer import kept
from rlsync.transfer.checksum import BoxSums, share_sums, tensor_sums
from rlsync.transfer.routes import Box, Layout, Piece, TensorInfo, chunk, contains, layout, relative, share, whole

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor, Replicate, Shard = (), (), ()


class Meshes:
    """Each device mesh's global ranks' coordinates and its sizes, read once: a DeviceMesh derives
    `mesh` and `size()` anew at every call (a fraction of a millisecond each), and a layout asks for
    every rank's box of every parameter. Keyed by identity: for the meshes of one model, alive while
    this is."""

    def __init__(self):
        self._known: dict[int, tuple[object, dict[int, tuple[int, ...]], tuple[int, ...]]] = {}

    def of(self, mesh) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:
        """-> ({global rank: its coordinate}, the mesh's size in each dimension)."""
        found = self._known.get(id(mesh))
        if found is None:
            grid = mesh.mesh
            sizes = tuple(grid.shape)
            found = mesh, dict(zip(grid.reshape(-1).tolist(), itertools.product(*map(range, sizes)))), sizes
            self._known[id(mesh)] = found
        return found[1], found[2]


def dtensor_boxes(t, meshes: Meshes) -> Callable[[int], Box | None]:
    """The box of `t`'s global shape that a global rank holds (None: one not in its mesh), as a
    function of the rank: the shape, mesh and placements are read once, for every rank to come."""
    coordinates, sizes = meshes.of(t.device_mesh)
    shape_box = whole(t.shape)
    cuts = []  # (mesh dimension, tensor dimension, parts) of each Shard placement, in order
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # Partial (a pending sum) or _StridedShard (FSDP2 over TP)
            raise InvalidArgument(f"a parameter placed as {placement} cannot be sent as it is: only Shard(dim) and "
                                  "Replicate placements are routed (reduce a Partial first; FSDP2 over tensor "
                                  "parallel is not routed yet)")
        cuts.append((mesh_dim, placement.dim, sizes[mesh_dim]))

    def box_of(rank: int) -> Box | None:
        coordinate = coordinates.get(rank)
        if coordinate is None:
            return None
        box = list(shape_box)
        for mesh_dim, dim, parts in cuts:
            start, stop = box[dim]
            a, b = chunk(stop - start, parts, coordinate[mesh_dim])
            box[dim] = (start + a, start + b)
        return tuple(box)

    return box_of


_Part = tuple[str, Callable[[int], "Box | None"], int]  # a part's name, its box by global rank, rows before it


def _region(view: View, shape: Sequence[int]) -> Box:
    """The box of a fused experts parameter of `shape` that `view` is (expert e's k-th row block)."""
    rows = shape[1] // view.chunks
    return ((view.expert, view.expert + 1), (view.chunk * rows, (view.chunk + 1) * rows),
            *((0, d) for d in shape[2:]))


def _in_view(box: Box | None, region: Box) -> Box | None:
    """What `box` (of the fused parameter) holds of `region` (a view's), in the view's coordinates (its
    expert dimension dropped); None when nothing."""
    if box is None:
        return None
    cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, region))
    if any(a >= b for a, b in cut):
        return None
    return tuple((a - c, b - c) for (a, b), (c, _) in zip(cut[1:], region[1:]))


def _viewed_boxes(box_of: Callable[[int], Box | None], region: Box) -> Callable[[int], Box | None]:
    return lambda rank: _in_view(box_of(rank), region)


def _stacked_boxes(box_of: Callable[[int], Box | None], view: Stacked, shape: tuple[int, ...]
                   ) -> Callable[[int], Box | None]:
    return lambda rank: view.box(box_of(rank), shape)


def _whole(box: Box, rank: int) -> Box:  # a plain tensor: every rank holds it whole
    return box


def _shifted(box: Box, rows: int) -> Box:
    """A part's box in its entry: moved down dim 0 by the rows of the parts before it."""
    return ((box[0][0] + rows, box[0][1] + rows), *box[1:]) if box and rows else box


def _entry_boxes(parts: list[_Part]) -> Callable[[int], tuple[Box, ...]]:
    """An entry's boxes in the engine tensor, as a function of the global rank (remembered)."""
    @functools.lru_cache(maxsize=None)
    def boxes(rank: int) -> tuple[Box, ...]:
        return tuple(_shifted(box, row) for _, box_of, row in parts if (box := box_of(rank)) is not None)

    return boxes


class RankShards:
    """What rank `rank` of `world` holds of each engine tensor (`entries`, made from `tensors`, the
    trainer's parameters by name), and the pieces of it that routes ask for.

    `global_ranks[r]`: the global rank of publisher rank r (DTensor meshes speak global ranks)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry], rank: int, world: int,
                 global_ranks: Sequence[int] | None = None):
        self.tensors, self.entries = tensors, list(entries)
        self.rank, self.world = rank, world
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world))
        infos = [TensorInfo(e.name, tuple(e.shape), e.dtype.itemsize) for e in self.entries]
        self._meshes = Meshes()
        # an expert view's slice of this rank's shard; a stacked parameter's box
        self._cuts: dict[tuple[str, View | Stacked], tuple] = {}
        self._found: dict[tuple, tuple] = {}  # (tensor, box) -> (its part, its cut of the part, dtype): piece()
        # checksum_share()'s plan (_Summed); its views live as long as this object,
        # which goes with its source at an offload (PublisherCore.drop_sender), as the sender's exports do
        self._summed: _Summed | None = None
        parts = self._parts()
        # Every rank's boxes of every entry: entries of the same parts' shapes and placements share them.
        by_kind: dict[tuple, Callable[[int], tuple[Box, ...]]] = {}
        boxes_of = [by_kind.setdefault(tuple((box_of, row) for _, box_of, row in p), _entry_boxes(p)) for p in parts]
        self.layout: Layout = layout(infos, [[f(self.global_ranks[r]) for f in boxes_of] for r in range(world)])
        # per entry: (box in the engine tensor, (part name, box in the part))
        self._mine = [self._boxes(entry_parts, self.global_ranks[rank]) for entry_parts in parts]
        # the parameters this rank's boxes are cut from, each once
        self._held = list(dict.fromkeys(part if isinstance(part, str) else part[0]
                                        for mine in self._mine for _, (part, _) in mine))

    def _parts(self) -> list[list[_Part]]:
        """Per entry, each part's (name, its box as a function of the global rank, rows before it in the
        entry), read once: a layout asks for every rank's box of every part."""
        meshes, out = self._meshes, []
        same: dict[tuple, Callable[[int], Box | None]] = {}  # parameters of one shape and placement share boxes
        viewed: dict[tuple, Callable[[int], Box | None]] = {}  # (its parameter's boxes, a view's region) -> boxes
        for entry in self.entries:
            parts, row = [], 0
            for part in entry.parts:
                t = self.tensors[part]
                if isinstance(t, DTensor):
                    key = (id(t.device_mesh), tuple(t.shape), tuple(t.placements))
                    if key not in same:
                        same[key] = dtensor_boxes(t, meshes)
                    box_of = same[key]
                else:
                    box_of = functools.partial(_whole, whole(t.shape))
                if isinstance(entry.view, Stacked):  # a fused parameter stacked: (name, view) is the part
                    key = (id(box_of), entry.view, tuple(t.shape))
                    box_of = viewed.setdefault(key, _stacked_boxes(box_of, entry.view, tuple(t.shape)))
                    parts.append(((part, entry.view), box_of, 0))
                    continue
                if entry.view is not None:  # one expert's rows of a fused parameter: (name, view) is the part
                    region = _region(entry.view, t.shape)
                    box_of = viewed.setdefault((id(box_of), region), _viewed_boxes(box_of, region))
                    parts.append(((part, entry.view), box_of, 0))
                    continue
                parts.append((part, box_of, row))
                row += t.shape[0] if t.dim() else 0
            out.append(parts)
        return out

    @staticmethod
    def _boxes(parts: list[_Part], rank: int) -> list[tuple[Box, tuple[str, Box]]]:
        return [(_shifted(box, row), (part, box)) for part, box_of, row in parts if (box := box_of(rank)) is not None]

    def piece(self, p: Piece) -> torch.Tensor:
        """The piece's values from this rank's local shard, contiguous, in the engine's dtype (a view
        when nothing needs copying; else one copy, which casts and gathers at once)."""
        values, dtype = self.piece_source(p)
        return values.to(dtype, memory_format=torch.contiguous_format)

    def piece_source(self, p: Piece) -> tuple[torch.Tensor, torch.dtype]:
        """The piece's values as they lie in this rank's local shard (a view: any strides, the trainer's dtype),
        and the dtype they travel in: a sender packing pieces copies them into its bucket, casting on the way."""
        found = self._found.get((p.tensor, p.box))
        if found is None:  # where a piece lies in this rank's parts is the same at every update
            entry = self.entries[p.tensor]
            hit = next(((box, part) for box, (part, _) in self._mine[p.tensor] if contains(box, p.box)), None)
            if hit is None:
                raise InvalidArgument(f"rank {self.rank} does not hold {entry.name!r}{[list(b) for b in p.box]}: the "
                                      "route was planned for another layout")
            region = relative(p.box, hit[0])
            found = self._found[(p.tensor, p.box)] = (hit[1], tuple(slice(a, b) for a, b in region), entry.dtype)
        part, cut, dtype = found
        local = self._local(part)  # detached: no autograd in what follows
        return (local[cut] if cut else local), dtype

    def refresh(self, ranks) -> None:
        """Nothing to bring up to date: pieces are cut from the shards as they are at the send."""

    def held_tensors(self) -> list[list[torch.Tensor]]:
        """This rank's boxes as tensors (its local shards, or parts of them), per engine tensor in its
        layout's order: what receiver ranks on its GPU pull from (rlsync.transfer.pulls)."""
        out = []
        with torch.no_grad():  # to_local() outside it builds an autograd node each: 3x the time (CPU)
            for index, boxes in enumerate(self.layout.held[self.rank]):
                mine = {box: part for box, (part, _) in self._mine[index]}
                out.append([self._local(mine[box]) for box in boxes])
        return out

    def where(self) -> tuple:
        """Where the tensors held_tensors() gives lie: kept.where of the local tensor of every parameter they
        are cut from (the same cut of the same local tensor is the same view). Equal while none has moved,
        at a look per parameter, where held_tensors() makes a view per box (a microsecond each, and
        to_local() of a parameter makes one too): a repeat update keys its export by it (ShardedSender)."""
        return kept.where([t._local_tensor if isinstance(t, DTensor) else t
                           for t in (self.tensors[name] for name in self._held)])

    def _local(self, part: str | tuple[str, View | Stacked]) -> torch.Tensor:
        """This rank's local values of a part: of a parameter, its local shard; of an expert's view, the rows
        of that expert its shard holds; of a stacked parameter, its shard stacked (views)."""
        name, view = part if isinstance(part, tuple) else (part, None)
        t = self.tensors[name]
        # (its local tensor as where() reads it: to_local() runs an autograd function, ~25 us a piece on a CPU)
        local = (t._local_tensor if isinstance(t, DTensor) else t).detach()
        if view is None:
            return local
        cut = self._cuts.get(part)
        if cut is None:  # (where this rank's shard holds the view: the same at every update)
            held = dtensor_boxes(t, self._meshes)(self.global_ranks[self.rank]) if isinstance(t, DTensor) \
                else whole(t.shape)
            if isinstance(view, Stacked):
                cut = view.box(held, tuple(t.shape))
            else:
                region = _region(view, t.shape)
                cut = tuple(slice(max(a, c) - a, min(b, d) - a) for (a, b), (c, d) in zip(held, region))
            self._cuts[part] = cut
        return view.local(local, cut) if isinstance(view, Stacked) else local[cut][0]

    def checksum_share(self, dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
        """This rank's share of each engine tensor's checksum sums (checksum.box_sums), cast to `dtype`
        when given: routes from every rank's boxes to one whole copy split each tensor among the ranks
        (a replicated box counts once), so the ranks' shares add up to the whole tensor's sums."""
        pieces, where = share(self.layout, self.rank), self.where()
        kept = self._summed
        if kept is None or kept.pieces is not pieces or kept.where != where:
            # where each piece lies in this rank's shards, found again only when a parameter moved
            kept = self._summed = _Summed(pieces, where, [self.piece_source(p) for p in pieces], {})
        planned = kept.by_dtype.get(dtype)
        if planned is None:  # which pieces are summed as they lie (no cast, no copy: most), and the sums' plan
            ready = [_cast(v, e, dtype) is v for v, e in kept.sources]
            planned = kept.by_dtype[dtype] = ready, share_sums(pieces, [e.shape for e in self.entries])
        ready, sums = planned
        values = (v if as_is else _cast(v, e, dtype) for (v, e), as_is in zip(kept.sources, ready))
        return tensor_sums(pieces, sums(values), len(self.entries))


class _Summed(NamedTuple):
    """What RankShards.checksum_share keeps while its layout and its shards stay: share's pieces, where(), each
    piece's values and the engine's dtype (piece_source), and per dtype summed in, which pieces are summed as they
    lie and the sums' plan."""

    pieces: tuple[Piece, ...]
    where: tuple
    sources: list[tuple[torch.Tensor, torch.dtype]]
    by_dtype: dict[torch.dtype | None, tuple[list[bool], BoxSums]]


def _cast(v: torch.Tensor, engine_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.Tensor:
    """A piece's values as summed: in the engine's dtype, contiguous (what piece() makes of it: a copy only where
    one is needed), then in `dtype` when given."""
    if v.dtype != engine_dtype or not v.is_contiguous():
        v = v.to(engine_dtype, memory_format=torch.contiguous_format)
    return v.to(dtype) if dtype is not None and v.dtype != dtype and v.is_floating_point() else v


def publisher_ranks(group=None) -> tuple[int, int, list[int]]:
    """(rank, world, global rank of each rank) of the publisher's process group (one process when
    torch.distributed is not set up)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, [0]
    world = dist.get_world_size(group)
    globals_ = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    return dist.get_rank(group), world, globals_
