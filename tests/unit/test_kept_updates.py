"""What a repeat routed update keeps (rlsync.transfer.kept): a repeat from and into memory that stayed uses
what the first update made (its writer, its split of the routes, the key a trainer rank exports by); a
storage that moved, another layout, other facts or other staging make it anew."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from rlsync.errors import DataLoss
from rlsync.publish.layout import RankShards
from rlsync.publish.mapping import WeightMap
from rlsync.transfer import kept, pulls
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routed import destinations
from rlsync.transfer.routes import TensorInfo, chunks, layout, plan_routes, whole
from rlsync.transfer.v1 import transfer_pb2 as pb
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


KEEP: dict = {}  # where the staging's owner keeps what is laid out over it (a FlatStore's memo)


def _writer(routes, staging, rank=0, keep=KEEP):
    made = []

    def lay_out():
        made.append(1)
        return destinations(routes, rank, SPECS, staging)
    return kept.writer(routes.of_receiver(rank), rank, SPECS, staging, torch.device("cpu"), keep, lay_out), len(made)


def test_a_repeat_with_the_same_values_makes_nothing_and_another_key_makes_it_anew():
    cache, made = kept.Kept(2), []
    assert cache.get(("layout", 1), lambda: made.append(1) or "first") == "first"
    assert cache.get(("layout", 1), lambda: made.append(1) or "again") == "first"
    assert cache.get(("layout", 2), lambda: made.append(1) or "second") == "second"
    assert (len(made), cache.hits, cache.misses) == (2, 1, 2)
    cache.get(("layout", 3), lambda: "third")  # the oldest of more than two goes
    assert cache.get(("layout", 1), lambda: "made again") == "made again"
    assert cache.peek(("layout", 4)) is None and cache.peek(("layout", 3)) == "third", "a missed peek keeps nothing"
    cache.put(("layout", 5), "fifth")
    assert cache.peek(("layout", 1)) is None and cache.peek(("layout", 3)) == "third"


def test_where_tensors_lie_changes_when_a_storage_moves_and_not_otherwise():
    params = [torch.zeros(4, 3), torch.ones(5)]
    before = kept.where(params)
    params[0].add_(1)  # an optimizer step in place: the same memory
    assert kept.where(params) == before
    moved = [params[0].clone(), params[1]]  # an optimizer that reallocates, an onload into new memory
    assert kept.where(moved) != before
    assert kept.where([params[0].t(), params[1]]) != before  # the same address laid out anew (a resharding)
    assert kept.where([params[0].to(torch.float64), params[1]]) != before


def test_a_staging_laid_out_alike_elsewhere_has_its_layout_and_other_addresses():
    """staging_layout: what a held pull's tables depend on (each view's place in its storage), apart from where
    the storages lie (a staging woken anew at another address gets the same tables, rebased)."""
    def staging(flat: torch.Tensor) -> dict:
        return {"a": (((0, 4),), flat[:4]), "b": (((0, 2), (0, 3)), flat[8:14].view(2, 3))}
    one, two = torch.zeros(16), torch.zeros(16)
    (laid, bases), (laid2, bases2) = kept.staging_layout(staging(one)), kept.staging_layout(staging(two))
    assert laid == laid2 and bases.tolist() == [one.data_ptr()] and bases2.tolist() == [two.data_ptr()]
    assert kept.staging_layout(staging(torch.zeros(20)))[0] != laid, "a larger storage: not rebased into"
    moved = {"a": (((0, 4),), one[1:5]), "b": staging(one)["b"]}
    assert kept.staging_layout(moved)[0] != laid


def test_a_repeat_routed_update_reuses_its_writer_and_receives_into_it_anew():
    KEEP.clear()
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


def test_a_receiver_keeps_no_view_of_staging_its_owner_keeps_nothing_for():
    routes, staging, keep = _routes(2, 2), _staging(2, 0), {}
    first, _ = _writer(routes, staging, keep=keep)
    assert _writer(routes, staging, keep=keep) == (first, 0)
    again, made = _writer(routes, staging, keep={})  # another owner's (a store made anew): nothing of the first
    assert made == 1 and again is not first
    lay_outs = []
    unheld = kept.writer(routes.of_receiver(0), 0, SPECS, staging, torch.device("cpu"), None,
                         lambda: lay_outs.append(1) or destinations(routes, 0, SPECS, staging))
    kept.writer(routes.of_receiver(0), 0, SPECS, staging, torch.device("cpu"), None,
                lambda: lay_outs.append(1) or destinations(routes, 0, SPECS, staging))
    assert len(lay_outs) == 2 and unheld is not first


def _facts(gpu: str) -> pb.Facts:
    return pb.Facts(host_id="h", device_type="cuda", gpu_uuids=[gpu])


def test_a_repeat_split_gets_the_very_routes_it_got_and_other_facts_or_routes_split_anew():
    routes = _routes(2, 2)
    memories = [pb.RankMemory(facts=_facts("gpu-0"), regions=3), pb.RankMemory(facts=_facts("gpu-1"), regions=3)]
    engine = [_facts("gpu-0"), _facts("gpu-1")]
    first = pulls.split(routes, memories, engine)
    again = pulls.split(routes, [pb.RankMemory.FromString(m.SerializeToString()) for m in memories], list(engine))
    assert again[0] is first[0] and again[1] is first[1], "the same routes and facts: the same objects"
    swapped = [_facts("gpu-1"), _facts("gpu-0")]  # the engine ranks swapped GPUs: other pairs pull
    moved = pulls.split(routes, memories, swapped)
    assert moved == pulls._split(routes, memories, swapped) and moved[0] != first[0]
    offloaded = pulls.split(routes, [memories[0], pb.RankMemory(facts=_facts("gpu-1"))], engine)  # nothing to map
    assert not any(t.dsts for t in offloaded[0].transfers if t.src == 1)
    replanned = pulls.split(_routes(2, 2), memories, engine)  # another plan: split anew, never taken for the last
    assert replanned[0] is not first[0] and replanned[0] == first[0]


def _rank_shards(rows: int = 8):
    """Rank 0 of 2 of an FSDP2-like model on a `fake` process group: a parameter per tensor, each rank's
    local shard its own storage."""
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = init_device_mesh("cpu", (2,))
    params = {name: nn.Parameter(distribute_tensor(torch.zeros(rows, 4), mesh, [Shard(0)]))
              for name in ("w1", "w2")}
    entries = WeightMap().plan([(n, tuple(t.shape), t.dtype) for n, t in params.items()])
    return params, RankShards(params, entries, 0, 2)


def test_a_ranks_where_stays_through_an_in_place_step_and_changes_when_a_shard_moves():
    try:
        params, shards = _rank_shards()
        before = shards.where()
        with torch.no_grad():
            params["w1"].add_(1.0)  # an optimizer step in place
        assert shards.where() == before
        held = [t.data_ptr() for tensors in shards.held_tensors() for t in tensors]
        assert held == [p.to_local().data_ptr() for p in params.values()], "where() names what held() cuts from"
        module = nn.ParameterDict(params)
        module.to(torch.float64).to(torch.float32)  # the same parameters in new memory (an offload and onload)
        assert all(module[n] is p for n, p in params.items()) and shards.where() != before
    finally:
        dist.destroy_process_group()


def test_an_fp8_ranks_where_names_its_boxes_from_the_first_send_on():
    """QuantizedShards: the sender keys a repeat's export by where(), asked before held_tensors(); the FP8
    boxes held_tensors() hands out are made by where() the first time, before the first refresh too (an offer
    describes them first), so the next send's key is the first's and names what held_tensors() cuts."""
    from types import SimpleNamespace

    from rlsync.publish.quantized import stage
    from rlsync.publish.quantized_shards import QuantizedShards
    from rlsync.quant.fp8_format import fp8_format
    from rlsync.transfer.routes import Piece

    try:
        params, shards = _rank_shards(rows=256)
        with torch.no_grad():
            for p in params.values():
                p.to_local().normal_()
        fmt = fp8_format({"quant_method": "fp8", "weight_block_size": [128, 128]}, ["w1", "w2"])
        specs, plan = stage([Spec(n, torch.float32, (256, 4), 4096) for n in params], fmt)
        q = QuantizedShards(shards, specs, plan, fmt, torch.device("cpu"))
        ranks = SimpleNamespace(agree=lambda ok: not ok, max_of=lambda t: t)  # (one rank's view: nothing to combine)
        first = q.where()  # an offer describes the storages before its refresh: the boxes are made, then filled
        held = [t.data_ptr() for tensors in q.held_tensors() for t in tensors]
        q.refresh(ranks)
        assert q.where() == first and [t.data_ptr() for tensors in q.held_tensors() for t in tensors] == held
        with torch.no_grad():
            params["w1"].to_local().mul_(-2.0)  # a training step, in place
        q.refresh(ranks)
        assert q.where() == first, "the second send's key is the first's"
        assert [t.data_ptr() for tensors in q.held_tensors() for t in tensors] == held
        box = q.layout.held[0][0][0]  # w1's FP8 rows on rank 0: what it holds now, quantized after the step
        assert torch.equal(q.held_tensors()[0][0].view(torch.uint8), q.piece(Piece(0, box)).view(torch.uint8))
    finally:
        dist.destroy_process_group()


def test_a_writer_kept_in_a_flat_stores_memo_goes_with_the_store():
    """RoutedReceiver keeps its writer in its FlatStore's memo: a repeat into the store lays nothing out, and
    nothing else keeps views of it, so the store's memory goes when its owner drops it."""
    import gc
    import weakref

    from rlsync.flat import FlatStore

    routes = _routes(2, 1)
    store = FlatStore({s.name: (s.shape, s.dtype) for s in SPECS})
    staging = {s.name: (whole(s.shape), store.views[s.name]) for s in SPECS}
    first, _ = _writer(routes, staging, keep=store.memo)
    assert _writer(routes, staging, keep=store.memo) == (first, 0)
    buffer = weakref.ref(store.buffers[torch.float32])
    del store, staging, first
    gc.collect()
    assert buffer() is None, "the kept writer's views went with the store"
