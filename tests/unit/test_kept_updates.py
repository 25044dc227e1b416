"""What a repeat routed update keeps (rlsync.transfer.kept): a repeat from and into memory that stayed uses
what the first update made; a storage that moved, another layout or other staging make it anew."""

import pytest
import torch

from rlsync.errors import DataLoss
from rlsync.transfer import kept
from rlsync.transfer.held import HELD, HeldMappings
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routed import destinations
from rlsync.transfer.routes import TensorInfo, chunks, layout, plan_routes, whole
from rlsync.transfer.writer import DestWriter

SHAPES = {"a": (8, 4), "b": (4,), "c": (6, 2)}
SPECS = [Spec(n, torch.float32, s, 4 * torch.Size(s).numel()) for n, s in SHAPES.items()]
INFOS = [TensorInfo(s.name, s.shape, 4) for s in SPECS]


def _routes(k: int, g: int):
    """k trainer ranks holding rows of every 2-D tensor, g engine ranks loading rows of them (1-D whole)."""
    def rows(n: int, r: int):
        return [[(chunks(s.shape[0], n)[r], *whole(s.shape)[1:])] if len(s.shape) == 2 else [whole(s.shape)]
                for s in SPECS]
    return plan_routes(layout(INFOS, [rows(k, r) for r in range(k)]), layout(INFOS, [rows(g, e) for e in range(g)]))


def _staging(g: int, rank: int):
    out = {}
    for s in SPECS:
        box = (chunks(s.shape[0], g)[rank], *whole(s.shape)[1:]) if len(s.shape) == 2 else whole(s.shape)
        out[s.name] = (box, torch.zeros(tuple(b - a for a, b in box)))
    return out


HOLDER = "test-kept"


def _writer(routes, staging, rank=0, held=HELD):
    made = []

    def lay_out():
        made.append(1)
        return destinations(routes, rank, SPECS, staging)
    return kept.writer(routes.of_receiver(rank), rank, SPECS, staging, torch.device("cpu"), held.kept(HOLDER),
                       lay_out), len(made)


def test_a_repeat_with_the_same_values_makes_nothing_and_another_key_makes_it_anew():
    cache, made = kept.Kept(2), []
    assert cache.get(("layout", 1), lambda: made.append(1) or "first") == "first"
    assert cache.get(("layout", 1), lambda: made.append(1) or "again") == "first"
    assert cache.get(("layout", 2), lambda: made.append(1) or "second") == "second"
    assert (len(made), cache.hits, cache.misses) == (2, 1, 2)
    cache.get(("layout", 3), lambda: "third")  # the oldest of more than two goes
    assert cache.get(("layout", 1), lambda: "made again") == "made again"


def test_where_tensors_lie_changes_when_a_storage_moves_and_not_otherwise():
    params = [torch.zeros(4, 3), torch.ones(5)]
    before = kept.where(params)
    params[0].add_(1)  # an optimizer step in place: the same memory
    assert kept.where(params) == before
    moved = [params[0].clone(), params[1]]  # an optimizer that reallocates, an onload into new memory
    assert kept.where(moved) != before
    assert kept.where([params[0].t(), params[1]]) != before  # the same address laid out anew (a resharding)
    assert kept.where([params[0].to(torch.float64), params[1]]) != before


def test_a_repeat_routed_update_reuses_its_writer_and_receives_into_it_anew():
    HELD.release(HOLDER)
    routes, staging = _routes(2, 2), _staging(2, 0)
    first, made = _writer(routes, staging)
    again, made_again = _writer(routes, dict(staging))  # the same tensors, in another dict: the same key
    assert (made, made_again) == (1, 0) and again is first
    assert again.received == [0] * len(again.specs)
    for i, spec in enumerate(again.specs):  # every byte of every piece, into the staging
        again.write(i, 0, torch.full((spec.nbytes // 4,), float(i + 1)).view(torch.uint8))
    assert again.finish() == sum(s.nbytes for s in again.specs)
    assert all(t.ne(0).all() for _, t in staging.values())  # through the kept views, into the staging
    third, _ = _writer(routes, staging)
    with pytest.raises(DataLoss, match="truncated"):  # ready for another transfer: nothing received yet
        third.finish()


def test_staging_that_moved_or_another_layout_lays_the_writer_out_anew():
    routes, staging = _routes(2, 2), _staging(2, 0)
    first, _ = _writer(routes, staging)
    moved = {**staging, "a": (staging["a"][0], staging["a"][1].clone())}  # an engine that reloaded a tensor
    second, made = _writer(routes, moved)
    assert made == 1 and second is not first
    assert second.tensors[0].data_ptr() != first.tensors[0].data_ptr()
    resharded = _routes(1, 2)  # the trainer's ranks changed: other routes, other pieces
    third, made = _writer(resharded, staging)
    assert made == 1 and third is not first
    fewer = _routes(2, 2)  # planned anew (not the cached plan's tuples): laid out anew, never taken for it
    assert _writer(fewer, staging)[1] == 1


def test_a_writer_made_ready_again_completes_empty_tensors_as_a_new_one_does():
    specs = [Spec("x", torch.float32, (2,), 8), Spec("empty", torch.float32, (0,), 0)]
    dest = {"x": torch.zeros(2), "empty": torch.zeros(0)}
    writer = DestWriter(specs, dest, torch.device("cpu"))
    writer.write(0, 0, torch.ones(2).view(torch.uint8))
    assert writer.finish() == 8
    writer.again().write(0, 0, torch.full((2,), 2.0).view(torch.uint8))
    assert writer.finish() == 8 and dest["x"].eq(2).all()


def test_a_receiver_that_holds_nothing_or_let_go_keeps_no_view_of_its_staging():
    routes, staging, held = _routes(2, 2), _staging(2, 0), HeldMappings()
    first, _ = _writer(routes, staging, held=held)
    assert _writer(routes, staging, held=held) == (first, 0)
    held.release(HOLDER)  # the engine may free its staging now: nothing of it is kept
    again, made = _writer(routes, staging, held=held)
    assert made == 1 and again is not first
    lay_outs = []
    unheld = kept.writer(routes.of_receiver(0), 0, SPECS, staging, torch.device("cpu"), None,
                         lambda: lay_outs.append(1) or destinations(routes, 0, SPECS, staging))
    kept.writer(routes.of_receiver(0), 0, SPECS, staging, torch.device("cpu"), None,
                lambda: lay_outs.append(1) or destinations(routes, 0, SPECS, staging))
    assert len(lay_outs) == 2 and unheld is not first
