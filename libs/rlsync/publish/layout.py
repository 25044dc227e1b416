"""A trainer rank's share of the engine's tensors: which boxes of each it holds (its routing layout),
and each piece a route asks of it, cut from its local shards with no collective.

DTensor placements give the boxes (Shard(d) split as torch.chunk splits, Replicate whole, several
mesh dimensions applied in order, as DTensor does); a plain tensor is held whole by every rank
(one process, or a replicated module under DDP). A fused engine tensor (WeightMap.fuse) is its
parts' boxes, each moved down dim 0 by the rows of the parts before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from rlsync.errors import InvalidArgument
from rlsync.publish.mapping import Entry
from rlsync.transfer.checksum import box_sums
from rlsync.transfer.routes import Box, Layout, Piece, TensorInfo, chunks, contains, layout, relative, share, whole

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor, Replicate, Shard = (), (), ()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtensor_box(t, rank: int) -> Box | None:
    """The box of `t`'s global shape that global rank `rank` holds; None when it is not in the mesh."""
    mesh = t.device_mesh
    where = (mesh.mesh == rank).nonzero()
    if not len(where):
        return None
    coordinate = where[0].tolist()
    box = list(whole(t.shape))
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:  # Partial (a pending sum) or _StridedShard (FSDP2 over TP)
            raise InvalidArgument(f"a parameter placed as {placement} cannot be sent as it is: only Shard(dim) and "
                                  "Replicate placements are routed (reduce a Partial first; FSDP2 over tensor "
                                  "parallel is not routed yet)")
        start, stop = box[placement.dim]
        a, b = chunks(stop - start, mesh.size(mesh_dim))[coordinate[mesh_dim]]
        box[placement.dim] = (start + a, start + b)
    return tuple(box)


class RankShards:
    """What rank `rank` of `world` holds of each engine tensor (`entries`, made from `tensors`, the
    trainer's parameters by name), and the pieces of it that routes ask for.

    `global_ranks[r]`: the global rank of publisher rank r (DTensor meshes speak global ranks)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], entries: Sequence[Entry], rank: int, world: int,
                 global_ranks: Sequence[int] | None = None):
        self.tensors, self.entries = tensors, list(entries)
        self.rank, self.world = rank, world
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world))
        infos = [TensorInfo(e.name, tuple(e.shape), _itemsize(e.dtype)) for e in self.entries]
        held = [[self._boxes(e, r) for e in self.entries] for r in range(world)]
        self.layout: Layout = layout(infos, [[[b for b, _ in boxes] for boxes in rank_boxes] for rank_boxes in held])
        self._mine = held[rank]  # per entry: (box in the engine tensor, (part name, box in the part))

    def _boxes(self, entry: Entry, rank: int) -> list[tuple[Box, tuple[str, Box]]]:
        out, row = [], 0
        for part in entry.parts:
            t = self.tensors[part]
            if isinstance(t, DTensor):
                box = dtensor_box(t, self.global_ranks[rank])
            else:
                box = whole(t.shape)
            if box is not None:
                shifted = ((box[0][0] + row, box[0][1] + row), *box[1:]) if box else box
                out.append((shifted, (part, box)))
            row += t.shape[0] if t.dim() else 0
        return out

    def piece(self, p: Piece) -> torch.Tensor:
        """The piece's values from this rank's local shard, contiguous, in the engine's dtype (a view
        when nothing needs copying)."""
        entry = self.entries[p.tensor]
        found = next(((box, part) for box, (part, _) in self._mine[p.tensor] if contains(box, p.box)), None)
        if found is None:
            raise InvalidArgument(f"rank {self.rank} does not hold {entry.name!r}{[list(b) for b in p.box]}: the route "
                                  "was planned for another layout")
        box, part = found
        with torch.no_grad():
            local = self._local(part)
        region = relative(p.box, box)
        out = local[tuple(slice(a, b) for a, b in region)] if region else local
        if out.dtype != entry.dtype:
            out = out.to(entry.dtype)
        return out.contiguous()

    def held_tensors(self) -> list[list[torch.Tensor]]:
        """This rank's boxes as tensors (its local shards, or parts of them), per engine tensor in its
        layout's order: what receiver ranks on its GPU pull from (rlsync.transfer.pulls)."""
        out = []
        with torch.no_grad():  # to_local() outside it builds an autograd node each: 3x the time (CPU)
            for index, boxes in enumerate(self.layout.held[self.rank]):
                mine = {box: part for box, (part, _) in self._mine[index]}
                out.append([self._local(mine[box]) for box in boxes])
        return out

    def _local(self, part: str) -> torch.Tensor:
        t = self.tensors[part]
        return (t.to_local() if isinstance(t, DTensor) else t).detach()

    def checksum_share(self, dtype: torch.dtype | None = None) -> list[tuple[int, int]]:
        """This rank's share of each engine tensor's checksum sums (checksum.box_sums), cast to `dtype`
        when given: routes from every rank's boxes to one whole copy split each tensor among the ranks
        (a replicated box counts once), so the ranks' shares add up to the whole tensor's sums."""
        sums = [(0, 0)] * len(self.entries)
        for p in share(self.layout, self.rank):
            values = self.piece(p)
            if dtype is not None and values.is_floating_point():
                values = values.to(dtype)
            s1, s2 = box_sums(values, p.box, self.entries[p.tensor].shape)
            sums[p.tensor] = (sums[p.tensor][0] + s1, sums[p.tensor][1] + s2)
        return sums


def publisher_ranks(group=None) -> tuple[int, int, list[int]]:
    """(rank, world, global rank of each rank) of the publisher's process group (one process when
    torch.distributed is not set up)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, [0]
    world = dist.get_world_size(group)
    globals_ = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    return dist.get_rank(group), world, globals_
