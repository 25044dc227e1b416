"""A sharded trainer rank's layout (rlsync.publish.layout.RankShards) over many ranks, in one process:
DTensors on a process group of torch's `fake` backend. Each rank's boxes are what DTensor itself says
that rank holds (its local shape and global offset), and every rank's view of the whole layout agrees."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from rlsync.checkpoint_names import Unfuse
from rlsync.publish.layout import RankShards
from rlsync.publish.mapping import WeightMap
from rlsync.transfer.routes import Piece

SHAPES = {"a": (37, 10), "b": (37, 10), "norm": (5,), "d": (16, 7), "e": (3, 16, 5), "tiny": (1, 4), "scale": ()}


def _placements(kind: str, dims: int) -> list | None:
    """None: a plain tensor, held whole by every rank."""
    if kind == "fsdp":
        return [Shard(0)] if dims else None
    if kind == "hsdp":
        return [Replicate(), Shard(0)] if dims else [Replicate(), Replicate()]
    if kind == "fsdp_tp":
        return [Shard(0), Shard(dims - 1)] if dims else None
    return [Shard(0), Shard(0)] if dims else None  # both mesh dimensions cut dim 0


def _model(mesh, kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in SHAPES.items():
        placements = _placements(kind, len(shape))
        if placements is None:
            out[name] = torch.zeros(shape)
            continue
        meta = torch.empty(shape, device="meta")
        out[name] = DTensor.from_local(torch.empty((1,) * len(shape), device="meta"), mesh, placements,
                                       run_check=False, shape=meta.shape, stride=meta.stride())
    return out


@pytest.mark.parametrize("mesh_shape, kind", [((6,), "fsdp"), ((4, 3), "hsdp"), ((3, 4), "fsdp_tp"),
                                              ((2, 4), "nested")])
@pytest.mark.parametrize("fused", [False, True])
def test_every_rank_holds_the_boxes_dtensor_says_and_every_rank_sees_the_same_layout(mesh_shape, kind, fused):
    world = 1
    for n in mesh_shape:
        world *= n
    layouts, mine = [], []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            params = _model(mesh, kind)
            weights = WeightMap(fuse={"ab": ["a", "b"]}) if fused else WeightMap()
            entries = weights.plan([(n, tuple(t.shape), t.dtype) for n, t in params.items()])
            shards = RankShards(params, entries, rank, world)
            layouts.append(shards.layout)
            for entry, held in zip(entries, shards._mine):
                assert [part for _, (part, _) in held] == [p for p in entry.parts if _holds(params[p], mesh)]
                for box, (part, part_box) in held:
                    t = params[part]
                    if isinstance(t, DTensor):
                        local, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
                        if 0 in local:  # an empty shard: where it "starts" is a convention, and no box of it moves
                            assert _volume(part_box) == 0, (rank, part)
                        else:
                            assert part_box == tuple((o, o + n) for o, n in zip(offset, local)), (rank, part)
                    else:
                        assert part_box == tuple((0, n) for n in t.shape)
                    rows = sum(params[p].shape[0] for p in entry.parts[:entry.parts.index(part)])
                    assert box == (((part_box[0][0] + rows, part_box[0][1] + rows), *part_box[1:]) if part_box
                                   else part_box)
            mine.append([[box for box, _ in held] for held in shards._mine])
        finally:
            dist.destroy_process_group()
    assert all(layout == layouts[0] for layout in layouts)
    for rank in range(world):  # (a box of no volume is left out of the layout)
        assert [list(b) for b in layouts[0].held[rank]] == [[b for b in boxes if _volume(b) or not b]
                                                            for boxes in mine[rank]]


def _holds(t, mesh) -> bool:
    return not isinstance(t, DTensor) or mesh.get_coordinate() is not None


def _volume(box) -> int:
    out = 1
    for a, b in box:
        out *= b - a
    return out


EXPERTS, ROWS, HIDDEN, WORLD = 4, 3, 4, 2
FUSED = torch.arange(EXPERTS * 2 * ROWS * HIDDEN, dtype=torch.float32).reshape(EXPERTS, 2 * ROWS, HIDDEN)
GATE_UP = Unfuse("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"))


def _fused_shards(dim: int):
    """(rank, its DTensor of gate_up [E, 2I, H] under Shard(dim) over 2 ranks), each in a fake group of its own."""
    for rank in range(WORLD):
        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (WORLD,))
            yield rank, DTensor.from_local(FUSED.chunk(WORLD, dim)[rank].clone(), mesh, [Shard(dim)], run_check=False,
                                           shape=FUSED.shape, stride=FUSED.stride())
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("dim", [0, 1, 2])  # FSDP2 cuts experts (dim 0); a cut of rows or columns splits each
def test_a_sharded_fused_experts_parameter_is_published_per_expert_from_each_ranks_own_rows(dim):
    """gate_up [E, 2I, H] under Shard(dim) over 2 ranks: each rank's boxes of expert e's gate and up tensors
    are what its shard holds of them, cut with no collective, and every element is held by some rank."""
    covered: dict[str, int] = {}
    entries = WeightMap().plan([("mlp.experts.gate_up_proj", tuple(FUSED.shape), FUSED.dtype)], [GATE_UP])
    assert [e.name for e in entries[:2]] == ["mlp.experts.0.gate_proj.weight", "mlp.experts.0.up_proj.weight"]
    for rank, param in _fused_shards(dim):
        shards = RankShards({"mlp.experts.gate_up_proj": param}, entries, rank, WORLD)
        for index, (entry, held) in enumerate(zip(entries, shards.layout.held[rank])):
            want = entry.view.of(FUSED)
            for box in held:
                got = shards.piece(Piece(index, box))
                assert torch.equal(got, want[tuple(slice(a, b) for a, b in box)]), (rank, entry.name, box)
                covered[entry.name] = covered.get(entry.name, 0) + _volume(box)
    assert covered == {e.name: ROWS * HIDDEN for e in entries}, "every element of every expert is held once"
    if dim == 0:
        assert not shards.layout.held[1][0] and shards.layout.held[1][-1], "whole experts per rank"


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_a_sharded_fused_experts_parameter_is_published_stacked_as_each_ranks_shard_stacked(dim):
    """gate_up [E, 2I, H] under Shard(dim) over 2 ranks, stacked ([E, 2, I, H]): each rank holds one box of it, its
    own shard (under Shard(1) of 2 ranks: the gate rows, the up rows), cut with no copy, and the boxes tile it."""
    from rlsync.checkpoint_names import Stacked

    (entry,) = WeightMap().plan([("mlp.experts.gate_up_proj", tuple(FUSED.shape), FUSED.dtype)], [GATE_UP],
                                stacked={"mlp.experts.gate_up_proj"})
    want, held_elements = Stacked(2).of(FUSED), 0
    for rank, param in _fused_shards(dim):
        shards = RankShards({"mlp.experts.gate_up_proj": param}, [entry], rank, WORLD)
        (box,) = shards.layout.held[rank][0]
        got = shards.piece(Piece(0, box))
        assert torch.equal(got, want[tuple(slice(a, b) for a, b in box)]), (rank, box)
        assert shards.piece_source(Piece(0, box))[0].data_ptr() == param.to_local().data_ptr(), "no copy"
        held_elements += _volume(box)
    assert held_elements == FUSED.numel()
