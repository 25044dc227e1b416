"""Routed transfers between real processes: trainer ranks holding FSDP2 / DTensor shards send each
engine rank exactly the boxes it loads, point to point over gloo; nothing is gathered anywhere. Both
ends are the library's (ShardedSender from an FSDP2 module, RoutedReceiver), as a replica uses them.
Two updates run one after the other, the trainer changing every value in place between them: the
second reuses the group the first formed, and lands the new values."""

import pytest

from transfer_helpers import run_routed


@pytest.mark.parametrize("senders,receivers,bucket", [(2, 2, 96), (1, 2, 50), (4, 2, 1 << 12)])
def test_each_engine_rank_receives_exactly_its_boxes_from_the_ranks_that_hold_them(senders, receivers, bucket):
    results = run_routed(senders, receivers, bucket, STEPS="1")
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these boxes differ from the whole tensors: {e['wrong']}"
        assert e["received"] == e["loads"], "an engine rank receives its shard's bytes, ratio 1.00"
        assert set(e["channels"]) == {"gloo"}, "on CPU every piece comes over the group"
        assert {"embed", "qk", "o", "norm", "scalar"} <= set(e["tensors"])
    for t in trainers:
        assert t["layout_as_expected"], "RankShards describes FSDP2 rows, Shard(1) columns and Replicate"
        assert t["sent"] == t["planned"], "a trainer rank sends what the routes plan"
        assert t["largest_pair"] <= t["held"], "no trainer rank sends a receiver more than it holds"
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)
    used = {tuple(r["groups"]) for r in results}
    assert len(used) == 1 and len(set(*used)) == 1 and "" not in set(*used), \
        f"every member took one group for both transfers (the second reused the first's): {used}"


@pytest.mark.parametrize("senders", [2, 3])
def test_fp8_replica_ranks_receive_the_whole_tensors_quantization_of_their_boxes(senders):
    """The replica holds embed, qk and o in block FP8 (16 x 12 blocks): every trainer rank quantizes the
    boxes it holds, which cut blocks by rows (FSDP2), by fused parts (qk) and by columns (o, Shard(1)); each
    engine rank's FP8 boxes and scales equal the reference quantizer of the whole tensors after a step,
    each byte sent once."""
    results = run_routed(senders, 2, 96, STEPS="1", FP8="1")
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these differ from the reference: {e['wrong']}"
        assert e["received"] == e["loads"]
        assert {"embed", "qk", "o", "embed_scale_inv", "qk_scale_inv", "o_scale_inv", "norm"} <= set(e["tensors"])
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)
