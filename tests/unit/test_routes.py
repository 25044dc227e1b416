"""Routing is pure: property checks over random shapes, rank counts and placements, no I/O."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.errors import InvalidArgument
from rlsync.transfer.manifest import Spec
from rlsync.transfer.sharded import layout_of, to_layout_proto
from rlsync.transfer.routes import (
    TensorInfo, chunks, contains, layout, plan_routes, volume, whole)


def _sharded(shape, dim, n, index):
    """Rank `index`'s box of a tensor split in `n` along `dim`, as DTensor's Shard does."""
    box = list(whole(shape))
    box[dim] = chunks(shape[dim], n)[index]
    return tuple(box)


@st.composite
def _case(draw):
    """Random tensors; a trainer of K ranks (each tensor replicated, sharded along a dim, or on a 2x2
    mesh sharded along two dims); an engine of replicas x TP ranks (each tensor whole, or sliced
    along a dim, with head groups replicated when TP exceeds their count)."""
    count = draw(st.integers(1, 4))
    tensors = [TensorInfo(f"t{i}", tuple(draw(st.lists(st.integers(0, 9), max_size=3))),
                          draw(st.sampled_from([1, 2, 4]))) for i in range(count)]
    k = draw(st.integers(1, 4))
    trainer = [[] for _ in range(k)]
    for t in tensors:
        how = draw(st.sampled_from(["replicate", "shard", "mesh", "fused"] if t.shape else ["replicate"]))
        cut = draw(st.integers(0, t.shape[0])) if t.shape else 0  # fused: two parts along dim 0
        dim = draw(st.integers(0, max(len(t.shape) - 1, 0)))
        for r in range(k):
            if how == "replicate":
                boxes = [whole(t.shape)]
            elif how == "mesh" and k == 4 and len(t.shape) >= 2:  # Shard(0) x Shard(1) on a 2x2 mesh
                box = _sharded(t.shape, 0, 2, r // 2)
                boxes = [tuple([box[0], chunks(t.shape[1], 2)[r % 2], *box[2:]])]
            elif how == "fused":  # parts [0, cut) and [cut, n) of dim 0, each split over the ranks
                boxes = [tuple([(start + a, start + b), *whole(t.shape)[1:]])
                         for start, stop in ((0, cut), (cut, t.shape[0])) for a, b in [chunks(stop - start, k)[r]]]
            else:
                boxes = [_sharded(t.shape, dim, k, r)]
            trainer[r].append(boxes)
    replicas, tp = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    engine = [[] for _ in range(replicas * tp)]
    for t in tensors:
        how = draw(st.sampled_from(["whole", "slice"] if t.shape else ["whole"]))
        dim = draw(st.integers(0, max(len(t.shape) - 1, 0)))
        groups = draw(st.sampled_from([g for g in (1, 2, 4) if tp % g == 0]))  # kv heads fewer than ranks
        for e in range(replicas * tp):
            rank = e % tp
            if how == "whole":
                engine[e].append([whole(t.shape)])
            else:
                engine[e].append([_sharded(t.shape, dim, groups, rank * groups // tp)])
    return tensors, layout(tensors, trainer), layout(tensors, engine)


@settings(max_examples=300, deadline=None)
@given(_case())
def test_every_engine_byte_comes_once_from_a_rank_that_holds_it(case):
    tensors, trainer, engine = case
    routes = plan_routes(trainer, engine)
    for e in range(engine.ranks):
        for index, t in enumerate(tensors):
            need = [b for b in engine.held[e][index]]
            got = [p.box for tr in routes.of_receiver(e) for p in tr.pieces if p.tensor == index]
            assert sum(volume(b) for b in got) == sum(volume(b) for b in need), (t, need, got)
            for i, a in enumerate(got):
                assert any(contains(n, a) for n in need)
                for b in got[i + 1:]:  # disjoint: no element arrives twice
                    assert any(a0 >= b1 or b0 >= a1 for (a0, a1), (b0, b1) in zip(a, b))
    pairs = [(tr.src, d) for tr in routes.transfers for d in tr.dsts]
    assert len(pairs) == len(set(pairs)), "a pair of ranks moves its bytes in one transfer"
    for tr in routes.transfers:
        assert tr.pieces and tr.dsts
        for p in tr.pieces:
            assert any(contains(b, p.box) for b in trainer.held[tr.src][p.tensor]), "sent by a rank that holds it"
        assert sum(p.nbytes(tensors) for p in tr.pieces) <= trainer.nbytes(tr.src), "a byte to a receiver once"
    assert routes.received_bytes() == [engine.nbytes(e) for e in range(engine.ranks)]
    assert sum(routes.sent_bytes()) == sum(routes.received_bytes())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.integers(2, 4), st.integers(1, 3))
def test_replicated_tensors_are_spread_over_the_ranks_that_hold_them(sizes, k, replicas):
    tensors = [TensorInfo(f"t{i}", (n,), 2) for i, n in enumerate(sizes)]
    trainer = layout(tensors, [[[whole(t.shape)] for t in tensors] for _ in range(k)])
    engine = layout(tensors, [[[whole(t.shape)] for t in tensors] for _ in range(replicas)])
    sent = plan_routes(trainer, engine).sent_bytes()
    assert sum(sent) == sum(n * 2 for n in sizes) * replicas, "each byte once to every replica"
    assert max(sent) - min(sent) <= max(sizes) * 2 * replicas


def test_fsdp_rows_to_tensor_parallel_columns():
    """FSDP2 over 2 ranks (rows) into TP=2 (a row-parallel weight: columns): four pieces, each rank
    sends half of its rows to each engine rank, nothing more."""
    t = [TensorInfo("o_proj.weight", (4, 6), 2)]
    trainer = layout(t, [[[((0, 2), (0, 6))]], [[((2, 4), (0, 6))]]])
    engine = layout(t, [[[((0, 4), (0, 3))]], [[((0, 4), (3, 6))]]])
    routes = plan_routes(trainer, engine)
    assert {(tr.src, tr.dsts, tr.pieces[0].box) for tr in routes.transfers} == {
        (0, (0,), ((0, 2), (0, 3))), (0, (1,), ((0, 2), (3, 6))),
        (1, (0,), ((2, 4), (0, 3))), (1, (1,), ((2, 4), (3, 6)))}
    assert routes.sent_bytes() == [24, 24] and routes.received_bytes() == [24, 24]


def test_a_receiver_takes_one_transfer_from_each_sender_and_alike_receivers_share_it():
    """FSDP2 over 2 ranks into 2 replicas of TP = 2: an expert's rows split among a replica's ranks beside a norm every
    rank loads. Each engine rank takes one transfer from each trainer rank (its rows and the norm together, not a
    message each), and the same TP rank of both replicas takes the same one (packed once, sent to both)."""
    t = [TensorInfo("experts.0.gate", (4, 6), 2), TensorInfo("norm", (6,), 2)]
    trainer = layout(t, [[[((0, 4), (0, 6))], [((0, 3),)]], [[], [((3, 6),)]]])
    tp = [[[((0, 2), (0, 6))], [((0, 6),)]], [[((2, 4), (0, 6))], [((0, 6),)]]]
    routes = plan_routes(trainer, layout(t, tp + tp))
    assert {(tr.src, tr.dsts) for tr in routes.transfers} == {(0, (0, 2)), (0, (1, 3)), (1, (0, 1, 2, 3))}
    rows_and_norm = next(tr for tr in routes.transfers if tr.dsts == (0, 2)).pieces
    assert [(p.tensor, p.box) for p in rows_and_norm] == [(0, ((0, 2), (0, 6))), (1, ((0, 3),))], "in tensor order"
    assert routes.received_bytes() == [36, 36, 36, 36]


def test_pieces_of_one_sender_and_receivers_merge_into_one_box():
    """Two trainer ranks' edges cut the grid, but what one rank sends one receiver is a single box."""
    t = [TensorInfo("w", (8, 4), 4)]
    trainer = layout(t, [[[((0, 8), (0, 4))]], [[((0, 8), (0, 4))]]])
    engine = layout(t, [[[((0, 8), (0, 4))]]])
    (only,) = plan_routes(trainer, engine).transfers
    assert only.pieces[0].box == ((0, 8), (0, 4))


def test_a_box_no_trainer_rank_holds_is_refused():
    t = [TensorInfo("w", (4,), 2)]
    with pytest.raises(InvalidArgument, match=r"no trainer rank holds 'w'\[\[2, 4\]\], which engine rank 0 loads"):
        plan_routes(layout(t, [[[((0, 2),)]]]), layout(t, [[[((0, 4),)]]]))


def test_layouts_of_different_tensors_are_refused_naming_them():
    a = [TensorInfo("w", (4,), 2), TensorInfo("b", (4,), 2)]
    b = [TensorInfo("w", (4,), 4), TensorInfo("c", (4,), 2)]
    with pytest.raises(InvalidArgument, match=r"'b' only on the trainer; 'c' only on the engine; 'w' is \[4\] x 2 B"):
        plan_routes(layout(a, [[[whole((4,))], [whole((4,))]]]), layout(b, [[[whole((4,))], [whole((4,))]]]))


def test_a_box_outside_its_tensor_is_refused():
    with pytest.raises(InvalidArgument, match=r"rank 0: box \[\[0, 5\]\] is not inside 'w' of shape \[4\]"):
        layout([TensorInfo("w", (4,), 2)], [[[((0, 5),)]]])


def test_chunks_split_as_torch_chunk_does():
    import torch

    for size in range(0, 12):
        for n in range(1, 6):
            parts = torch.arange(size).chunk(n) if size else ()
            expected = [(int(p[0]), int(p[-1]) + 1) for p in parts if p.numel()]
            assert [c for c in chunks(size, n) if c[1] > c[0]] == expected


def test_a_layout_described_again_is_the_same_layout_and_a_bad_one_is_refused_every_time():
    """layout_of keeps the last few by their bytes: the same ranks again give the same Layout (so
    cached_routes finds it at once); other boxes another; a refusal is never remembered."""
    specs = [Spec("w", torch.float32, (4, 2), 32)]
    top, bottom = to_layout_proto([[((0, 2), (0, 2))]]), to_layout_proto([[((2, 4), (0, 2))]])
    first = layout_of(specs, [top, bottom])
    assert layout_of(list(specs), [to_layout_proto([[((0, 2), (0, 2))]]), bottom]) is first
    assert layout_of(specs, [bottom, top]).held == (first.held[1], first.held[0])
    outside = to_layout_proto([[((0, 5), (0, 2))]])
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="not inside"):
            layout_of(specs, [outside])
