"""A sender packs a bucket's whole pieces from where they lie in one launch, cast on the way, and a repeat
from the same storages reuses how it packed (routed.Plans): the bytes sent are the pieces' bytes in the
engine's dtype, the first time, after the values change in place, and (packed anew) after the storages
move or a send is cut short. Pure logic: a stand-in process group records what each send carries."""

import pytest
import torch

from rlsync.publish.layout import RankShards
from rlsync.publish.mapping import WeightMap
from rlsync.transfer import routed
from rlsync.transfer.control import Deadline
from rlsync.transfer.routes import TensorInfo, cached_routes, layout, whole


class Done:
    def wait(self, timeout=None) -> bool:
        return True


class RecordingGroup:
    """Each send's bytes as they are when it is posted (a send on CPU copies nothing later)."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, tensors, dst, tag):
        self.sent.append(tensors[0].numpy().tobytes())
        return Done()


def _wire(shards: RankShards, routes) -> bytes:
    """What the buckets should carry: every piece of every transfer, in the engine's dtype, in schedule order."""
    out = b""
    for op in routed.schedule(routes, 256):
        transfer = routes.transfers[op.transfer]
        for s in op.bucket.slices:
            data = shards.piece(transfer.pieces[s.tensor]).reshape(-1).view(torch.uint8)
            out += data[s.src:s.src + s.length].numpy().tobytes()
    return out


def _send(shards: RankShards, routes, packs) -> bytes:
    group = RecordingGroup()
    routed.send(group, routes, 0, shards.piece, 256, Deadline(5, "test"), torch.device("cpu"), None,
                shards.piece_source, packs)
    return b"".join(group.sent)


def test_a_repeat_packs_each_bucket_from_the_views_it_kept_and_sends_the_new_values():
    # fp32, sent as bf16; d larger than a bucket (256 bytes): its parts packed as bytes
    params = {"a": torch.randn(6, 4), "b": torch.randn(5), "c": torch.randn(3, 7), "d": torch.randn(40, 8)}
    entries = WeightMap(dtype=torch.bfloat16).plan([(n, tuple(p.shape), p.dtype) for n, p in params.items()])
    shards = RankShards(params, entries, 0, 1)
    infos = [TensorInfo(e.name, tuple(e.shape), e.dtype.itemsize) for e in entries]
    # One engine rank loading columns 1..3 of each 2-D tensor (strided in the trainer's rows) and all of b.
    boxes = [[((0, 6), (1, 3))], [whole((5,))], [((0, 3), (1, 3))], [whole((40, 8))]]
    routes = cached_routes(shards.layout, layout(infos, [boxes]))
    packs = routed.Plans()

    first = _send(shards, routes, packs)
    assert first == _wire(shards, routes), "the pieces' bf16 bytes"
    assert any(into for _, into, _, _ in packs.buckets.values()), "whole pieces packed in one launch"
    assert any(rest for _, _, _, rest in packs.buckets.values()), "the parts of d as bytes"
    kept = dict(packs.buckets)
    with torch.no_grad():
        for p in params.values():
            p.mul_(3).add_(1)  # in place: the same storages
    again = _send(shards, routes, packs)
    assert again == _wire(shards, routes) != first, "the repeat sends the new values"
    assert all(packs.buckets[tag] is kept[tag] for tag in kept), "from the views it kept"

    def failing(p):
        raise RuntimeError("cut short")

    cut_short = routed.Plans()
    cut_short.buckets, cut_short.slots = dict(packs.buckets), packs.slots
    with pytest.raises(RuntimeError, match="cut short"):
        routed.send(RecordingGroup(), routes, 0, failing, 256, Deadline(5, "test"), torch.device("cpu"), None,
                    None, cut_short)
    assert not cut_short.buckets and cut_short.slots is None, \
        "a send cut short leaves nothing to repeat (a slot it took for a bucket it kept no plan of)"

    where = shards.where()  # what a sender keys its Plans by
    moved = {n: p.clone() * 2 for n, p in params.items()}  # another optimizer's storages: other addresses
    shards = RankShards(moved, entries, 0, 1)
    assert shards.where() != where, "storages that moved are another key: packed anew"
    assert _send(shards, routes, routed.Plans()) == _wire(shards, routes)
