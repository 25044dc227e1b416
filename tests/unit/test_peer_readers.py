"""Which replicas keep a trainer's weights mapped, and which of them pull the weights from another GPU
(rlsync.publish.holders): the rings themselves are stubbed (pure logic; the GPU test is
tests/gpu/test_peer_gpu.py)."""

from __future__ import annotations

import asyncio

import pytest

from rlsync.publish import holders as module
from rlsync.publish.holders import Holders
from rlsync.rollout.v1 import rollout_pb2
from rlsync.rpc.doorbell import Lines
from rlsync.transfer.v1 import transfer_pb2 as pb

REGIONS = (pb.MappedTensors(ipc=[pb.CudaIpcHandle(device=0, handle=b"weights").SerializeToString()]), pb.Facts())
GPUS = {"near": "", "a": "gpu-1", "b": "gpu-1", "c": "gpu-2"}  # replica -> its GPU when not the trainer's


def _bell(name: str) -> pb.Doorbell:
    return pb.Doorbell(host_id="h", address=f"@{name}", name=name)


@pytest.fixture
def rings(monkeypatch):
    """Every replica holds when asked, answering with its GPU; what each ring asked is recorded."""
    asked = {"hold": [], "release": []}

    async def hold(holder, mapped, facts, doorbells, token, lines=None, routing=None):
        asked["hold"] += [d.name for d in doorbells]
        return [(d, rollout_pb2.HoldWeightsResponse(peer_gpu=GPUS[d.name])) for d in doorbells]

    async def release(holder, doorbells, token, lines=None):
        asked["release"] += [d.name for d in doorbells]
        return len(doorbells)

    monkeypatch.setattr(module, "ring_hold", hold)
    monkeypatch.setattr(module, "ring_release", release)
    return asked


def _hold(holders: Holders, names: list[str], peers: bool = True) -> None:
    async def run():
        await holders.hold(REGIONS, [_bell(n) for n in names], peers)
        await asyncio.sleep(0)  # a release in the background runs
    asyncio.run(run())


def test_replicas_on_one_peer_gpu_pull_and_the_trainers_own_gpu_is_no_peer(rings):
    holders = Holders("trainer", "", Lines())
    _hold(holders, ["near", "a", "b"])
    assert sorted(holders.peer_readers(REGIONS)) == ["a", "b"] and rings["release"] == []
    assert set(holders.holding) == {"@near", "@a", "@b"}
    assert holders.peer_readers((pb.MappedTensors(ipc=[b"another buffer"]), pb.Facts())) == []
    assert holders.peer_readers(None) == []
    _hold(holders, ["near", "a", "b"])
    assert rings["hold"] == ["near", "a", "b"], "each is asked once per set of storages"


def test_readers_on_another_peer_gpu_let_go_and_take_the_broadcast(rings):
    holders = Holders("trainer", "", Lines())
    _hold(holders, ["near", "a", "b", "c"])
    assert sorted(holders.peer_readers(REGIONS)) == ["a", "b"], "the largest group on one GPU keeps pulling"
    assert rings["release"] == ["c"] and holders.cannot_hold == {"@c"}
    _hold(holders, ["near", "a", "b", "c"])
    assert rings["hold"] == ["near", "a", "b", "c"], "c is not asked again"


def test_a_colocated_trainer_lets_no_replica_pull_across_gpus(rings):
    holders = Holders("trainer", "", Lines())
    _hold(holders, ["near", "a"], peers=False)  # at an onload: a holds, is found on gpu-1, and lets go
    assert holders.peer_readers(REGIONS) == [] and set(holders.holding) == {"@near"} and rings["release"] == ["a"]
    assert asyncio.run(holders.release()) == 1  # the offload
    _hold(holders, ["near", "a"], peers=False)
    assert rings["hold"] == ["near", "a", "near"], "a, known to be on another GPU, is not asked at the next onload"


def test_a_holder_no_longer_rung_is_forgotten_and_let_go(rings):
    holders = Holders("trainer", "", Lines())
    _hold(holders, ["near", "a"])
    assert holders.peer_readers(REGIONS) == ["a"]
    _hold(holders, ["near"])  # a left the rotation (it died, say)
    assert holders.peer_readers(REGIONS) == [] and rings["release"] == ["a"] and set(holders.holding) == {"@near"}
