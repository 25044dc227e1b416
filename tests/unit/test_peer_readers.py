"""Which replicas on other GPUs the trainer lets pull its weights over P2P (PublisherServicer): those that
hold them, while they are all on one GPU; readers on several GPUs let go and take NCCL's broadcast."""

from __future__ import annotations

import asyncio

from rlsync.publish.servicer import PublisherServicer
from rlsync.rollout.v1 import rollout_pb2
from rlsync.transfer.v1 import transfer_pb2 as pb

REGIONS = (pb.MappedTensors(ipc=[pb.CudaIpcHandle(device=0, handle=b"weights").SerializeToString()]), pb.Facts())


def _holders(servicer: PublisherServicer, gpus: dict[str, str]) -> None:
    """Replicas named by `gpus` hold REGIONS, each from that GPU ("": the trainer's own)."""
    doorbells = {name: pb.Doorbell(host_id="another host: rung by nobody", address=f"@{name}", name=name)
                 for name in gpus}
    servicer._held(REGIONS, [(doorbells[n], rollout_pb2.HoldWeightsResponse(peer_gpu=g)) for n, g in gpus.items()])
    asyncio.run(servicer._peers_on_one_gpu())


def test_readers_on_one_peer_gpu_pull_and_the_trainers_own_gpu_is_no_peer():
    servicer = PublisherServicer(publisher=None)
    _holders(servicer, {"near": "", "a": "gpu-1", "b": "gpu-1"})
    assert sorted(servicer._peer_readers(REGIONS)) == ["a", "b"]
    assert servicer.cannot_hold == set() and set(servicer.holding) == {"@near", "@a", "@b"}
    other = (pb.MappedTensors(ipc=[b"another buffer"]), pb.Facts())
    assert servicer._peer_readers(other) == [], "only those that hold this offer's storages"
    assert servicer._peer_readers(None) == []


def test_readers_on_two_peer_gpus_let_go_and_take_the_broadcast():
    servicer = PublisherServicer(publisher=None)
    _holders(servicer, {"near": "", "a": "gpu-1"})
    assert servicer._peer_readers(REGIONS) == ["a"]
    _holders(servicer, {"c": "gpu-2"})  # one joins on another GPU: both let go, for good (until an Offload)
    assert servicer._peer_readers(REGIONS) == []
    assert servicer.cannot_hold == {"@a", "@c"} and set(servicer.holding) == {"@near"}
