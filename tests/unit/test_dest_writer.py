"""DestWriter over an engine's flat weights: a FlatStore laid out as the manifest is taken whole,
without looking at any tensor; any other layout falls back to per-tensor destinations."""

import pytest
import torch

from rlsync.flat import FlatStore
from rlsync.transfer.manifest import Spec
from rlsync.transfer.plan import plan_buckets
from rlsync.transfer.spans import span
from rlsync.transfer.writer import DestWriter

SHAPES = {"a": (3, 4), "b": (5,), "empty": (0, 2), "c": (2, 2, 2)}


def _store(shapes, dtypes=None):
    return FlatStore({n: (torch.Size(s), (dtypes or {}).get(n, torch.bfloat16)) for n, s in shapes.items()})


def _specs(store: FlatStore, order) -> list[Spec]:
    return [Spec.of(n, store.views[n]) for n in order]


def _sent(specs):
    return {s.name: torch.randn(s.shape).to(s.dtype) for s in specs}


def test_a_store_laid_out_as_the_manifest_is_one_buffer():
    store = _store(SHAPES)
    specs = _specs(store, SHAPES)
    writer = DestWriter(specs, store, torch.device("cpu"))
    assert writer.whole is not None and writer.whole.data_ptr() == store.buffers[torch.bfloat16].data_ptr()
    assert "tensors" not in vars(writer), "no per-tensor work for a flat store"
    sent = _sent(specs)
    writer.write_whole(torch.cat([sent[s.name].reshape(-1) for s in specs]).view(torch.uint8))
    assert writer.finish() == sum(s.nbytes for s in specs)
    assert all(torch.equal(store.views[n], t) for n, t in sent.items())


def test_a_store_matches_its_layout_and_nothing_else_and_keeps_the_specs_it_matched():
    store = _store(SHAPES)
    specs = _specs(store, SHAPES)
    assert store.laid_out_as(specs) and store._matched == tuple(specs)
    assert store.laid_out_as(list(specs))  # the same specs again (a tuple of them: by identity)
    assert not store.laid_out_as(_specs(store, ["c", "a", "empty", "b"]))
    assert not store.laid_out_as(specs[:-1])
    other = [Spec.of(s.name, torch.zeros(s.shape, dtype=torch.float32)) for s in specs]
    assert not store.laid_out_as(other)
    assert store.laid_out_as(specs)


def test_a_delta_base_given_as_a_store_is_checked_against_the_manifest():
    from rlsync.errors import InvalidArgument
    from rlsync.transfer import WeightSender, answer
    from rlsync.transfer.receiver import Receiver
    from rlsync.transfer.source import ResidentSource

    store = _store(SHAPES)
    with WeightSender(ResidentSource(dict(_store(SHAPES).views))) as sender:
        offer = sender.offer(version=2)
    ans = answer(offer, "r0", force="gloo", base_version=1)
    ans.pull = True  # (no connection: only the construction is under test)
    assert ans.delta
    assert Receiver(offer, ans, _store(SHAPES), base=store).base is store.views
    wrong = _store({**SHAPES, "b": (6,)})
    with pytest.raises(InvalidArgument, match="'b'"):
        Receiver(offer, ans, _store(SHAPES), base=wrong)


def test_another_order_or_mixed_dtypes_fall_back_to_each_tensor():
    for store, order in ((_store(SHAPES), ["c", "a", "empty", "b"]),
                         (_store(SHAPES, {"b": torch.float32}), list(SHAPES))):
        specs = _specs(store, order)
        writer = DestWriter(specs, store, torch.device("cpu"))
        assert writer.whole is None and all(writer.direct)
        sent = _sent(specs)
        for i, s in enumerate(specs):
            writer.write(i, 0, sent[s.name].reshape(-1).view(torch.uint8))
        assert writer.finish() == sum(s.nbytes for s in specs)
        assert all(torch.equal(store.views[n], t) for n, t in sent.items())


def test_tensors_sent_in_another_dtype_are_cast_as_they_are_written():
    """A pull that casts (fp32 at the sender, bf16 in the manifest): each tensor lands as the sender's own
    cast would make it, in place or through the buffer of a destination in a third dtype."""
    from rlsync.errors import DataLoss

    store = _store(SHAPES, {"b": torch.float16})
    specs = [Spec(s.name, torch.bfloat16, s.shape, s.nbytes // s.dtype.itemsize * 2) for s in _specs(store, SHAPES)]
    sent = {s.name: torch.randn(s.shape) * 3 for s in specs}
    writer = DestWriter(specs, store, torch.device("cpu"))
    writer.write_cast([sent[s.name].reshape(-1) if s.nbytes else None for s in specs])
    assert writer.finish() == sum(s.nbytes for s in specs)
    assert all(torch.equal(store.views[n], t.to(torch.bfloat16).to(store.views[n].dtype)) for n, t in sent.items())
    short = DestWriter(specs, store, torch.device("cpu"))
    with pytest.raises(DataLoss, match="'a': 11 elements sent"):
        short.write_cast([torch.zeros(11)] + [None] * (len(specs) - 1))


@pytest.mark.parametrize("bucket_bytes", [7, 24, 1 << 20])
def test_a_buckets_slices_land_in_one_view_cut_from_the_flat_store(bucket_bytes):
    """A broadcast lands each bucket straight in place: over a flat store its view is cut from the
    one buffer by offsets alone (no view of any tensor), and it is where the slices' own views are."""
    store = _store(SHAPES)
    specs = _specs(store, SHAPES)
    writer = DestWriter(specs, store, torch.device("cpu"))
    plan = plan_buckets([s.nbytes for s in specs], bucket_bytes)
    views = [writer.direct_span(b.slices) for b in plan]
    assert "targets" not in vars(writer) and "tensors" not in vars(writer)
    for bucket, view in zip(plan, views):
        parts = [writer.direct_view(s.tensor, s.src, s.length) for s in bucket.slices]
        assert view is not None and view.numel() == bucket.nbytes
        assert view.data_ptr() == span(parts).data_ptr()
    torch.manual_seed(0)
    stream = torch.randint(0, 256, (sum(s.nbytes for s in specs),), dtype=torch.uint8)
    for bucket, view in zip(plan, views):  # as a broadcast writes each bucket, then marks its slices
        start = bucket.index * bucket_bytes
        view.copy_(stream[start:start + bucket.nbytes])
        for s in bucket.slices:
            writer.mark(s.tensor, s.length)
    assert writer.finish() == stream.numel()
    assert torch.equal(store.buffers[torch.bfloat16].view(torch.uint8), stream)


def test_separate_tensors_take_a_bucket_in_place_only_within_one_of_them():
    dest = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    specs = [Spec.of(n, t) for n, t in dest.items()]
    writer = DestWriter(specs, dest, torch.device("cpu"))
    assert writer.whole is None  # separate allocations
    plan = plan_buckets([s.nbytes for s in specs], 1 << 20)
    assert writer.direct_span(plan[0].slices) is None  # several tensors: staged, then copied
    one = plan_buckets([s.nbytes for s in specs], 8)[0]  # 8 bytes of "a"
    assert writer.direct_span(one.slices).data_ptr() == dest["a"].data_ptr()
