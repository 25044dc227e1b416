"""Backend choice by topology, forced backends, and refusals that say what to fix."""

import pytest

from rlsync.errors import FailedPrecondition
from rlsync.transfer.handshake import PROTOCOL_VERSION, choose_backend, make_answer
from rlsync.transfer.v1 import transfer_pb2 as pb

ALL = [pb.BACKEND_CUDA_IPC, pb.BACKEND_NCCL, pb.BACKEND_SHM, pb.BACKEND_GLOO]


def facts(host="h1", device="cpu", gpus=()):
    return pb.Facts(host_id=host, device_type=device, gpu_uuids=list(gpus), hostname=host)


def offer(sender, backends=ALL, protocol=PROTOCOL_VERSION):
    return pb.Offer(protocol_version=protocol, facts=sender, backends=backends)


@pytest.mark.parametrize("sender, receiver, want", [
    (facts(device="cuda", gpus=["g0"]), facts(device="cuda", gpus=["g0"]), pb.BACKEND_CUDA_IPC),
    (facts(device="cuda", gpus=["g0"]), facts(device="cuda", gpus=["g1"]), pb.BACKEND_NCCL),
    (facts(device="cuda", gpus=["g0"]), facts("h2", device="cuda", gpus=["g0"]), pb.BACKEND_NCCL),
    (facts(), facts(), pb.BACKEND_SHM),
    (facts(device="cuda", gpus=["g0"]), facts(), pb.BACKEND_SHM),
    (facts(), facts("h2"), pb.BACKEND_GLOO),
    (facts(device="cuda", gpus=["g0"]), facts("h2"), pb.BACKEND_GLOO),
])
def test_topology_picks_the_fastest_channel(sender, receiver, want):
    backend, reason = choose_backend(offer(sender), receiver)
    assert backend == want and reason


@pytest.mark.parametrize("peers, reader, host, want", [
    (["g0"], "r1", "h1", pb.BACKEND_CUDA_IPC),  # a reader the offer names, reading g0 by P2P
    (["g0"], "r2", "h1", pb.BACKEND_NCCL),  # another replica named: a broadcast
    (["g0"], "", "h1", pb.BACKEND_NCCL),  # no reader named (readers on several GPUs would share g0's links)
    ([], "r1", "h1", pb.BACKEND_NCCL),  # named, but its GPU does not read g0 by P2P
    (["g2"], "r1", "h1", pb.BACKEND_NCCL),  # it reads another GPU
    (["g0"], "r1", "h2", pb.BACKEND_NCCL),  # another host's GPU of the same name
])
def test_one_named_receiver_on_a_peer_gpu_maps_the_senders_memory(peers, reader, host, want):
    sent = offer(facts(device="cuda", gpus=["g0"]))
    sent.peer_readers.extend([reader] if reader else [])
    receiver = pb.Facts(host_id=host, device_type="cuda", gpu_uuids=["g1"], peer_uuids=peers, hostname=host)
    ans = make_answer(sent, "r1", receiver)
    assert ans.backend == want
    if want == pb.BACKEND_CUDA_IPC:
        assert "peer GPU" in ans.reason and "g0" in ans.reason
        assert make_answer(sent, "r1", receiver, force=pb.BACKEND_CUDA_IPC).backend == want
    else:
        with pytest.raises(FailedPrecondition, match="cuda_ipc was forced but cannot work here"):
            make_answer(sent, "r1", receiver, force=pb.BACKEND_CUDA_IPC)


def test_falls_back_when_a_backend_is_missing_on_the_receiver():
    cuda = facts(device="cuda", gpus=["g0"])
    backend, _ = choose_backend(offer(cuda), cuda, available={pb.BACKEND_SHM, pb.BACKEND_GLOO})
    assert backend == pb.BACKEND_SHM


def test_a_receiver_on_the_senders_gpu_that_cannot_map_it_takes_shm_not_nccl():
    cuda = facts(device="cuda", gpus=["g0"])  # NCCL takes no two ranks on one GPU
    backend, _ = choose_backend(offer(cuda), cuda, available={pb.BACKEND_NCCL, pb.BACKEND_SHM, pb.BACKEND_GLOO})
    assert backend == pb.BACKEND_SHM


def test_forced_backend_is_honoured_when_it_can_work():
    backend, reason = choose_backend(offer(facts()), facts(), force=pb.BACKEND_GLOO)
    assert backend == pb.BACKEND_GLOO and "forced" in reason


@pytest.mark.parametrize("sender, receiver, force, fragment", [
    (facts(), facts("h2"), pb.BACKEND_SHM, "shm needs both processes on one host"),
    (facts(device="cuda", gpus=["g0"]), facts(device="cuda", gpus=["g1"]), pb.BACKEND_CUDA_IPC,
     "cuda_ipc needs the same GPU"),
    (facts(), facts(), pb.BACKEND_NCCL, "nccl needs CUDA tensors on both sides"),
])
def test_forced_backend_that_cannot_work_says_why(sender, receiver, force, fragment):
    with pytest.raises(FailedPrecondition, match=fragment):
        choose_backend(offer(sender), receiver, force=force)


def test_forced_backend_not_offered():
    with pytest.raises(FailedPrecondition, match="sender offers only shm"):
        choose_backend(offer(facts(), backends=[pb.BACKEND_SHM]), facts(), force=pb.BACKEND_GLOO)


def test_protocol_mismatch_says_to_align_releases():
    with pytest.raises(FailedPrecondition, match="protocol mismatch.*same rlsync release"):
        choose_backend(offer(facts(), protocol=PROTOCOL_VERSION + 1), facts())


def test_no_common_backend_lists_every_refusal():
    with pytest.raises(FailedPrecondition, match="no transfer backend works.*shm: shm needs.*gloo: not offered"):
        choose_backend(offer(facts(), backends=[pb.BACKEND_SHM]), facts("h2"))


@pytest.mark.parametrize("receiver, mapped, pull", [
    (facts(device="cuda", gpus=["g0"]), True, True),  # same GPU, memory described: it maps and copies itself
    (facts(device="cuda", gpus=["g0"]), False, False),  # same GPU, staged sender: the sender pushes
    (facts(device="cuda", gpus=["g1"]), True, False),  # another GPU: nccl, pushed
    (facts(), True, False),  # CPU receiver: shm, pushed
])
def test_a_receiver_pulls_only_memory_it_can_map(receiver, mapped, pull):
    o = offer(facts(device="cuda", gpus=["g0"]))
    if mapped:
        o.mapped.CopyFrom(pb.MappedTensors(ipc=[b"handle"], region=[0], offset=[0]))
    assert make_answer(o, "r", receiver).pull is pull
