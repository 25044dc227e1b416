"""What a push reports when some replicas pulled the bytes while they prepared, and a pull answer
the offer did not allow."""

import pytest
import torch

from rlsync.client.weights import _pushed, _report
from rlsync.errors import FailedPrecondition
from rlsync.transfer import WeightSender, answer
from rlsync.trainer.v1 import trainer_pb2
from rlsync.transfer.v1 import transfer_pb2 as pb

OFFER = pb.Offer(manifest=pb.Manifest(version=3, tensors=[pb.TensorSpec(name=n, nbytes=10) for n in "abc"]))


def test_when_every_replica_pulled_nothing_is_published_and_the_answers_say_it_all():
    answers = [pb.Answer(backend=pb.BACKEND_CUDA_IPC, ranks=1, pull=True, stages={"map": 0.001, "copy": 0.002}),
               pb.Answer(backend=pb.BACKEND_CUDA_IPC, ranks=2, pull=True, stages={"map": 0.003, "copy": 0.001})]
    assert _pushed(answers) == []
    report = _report(OFFER, None, {"offer": 0.001, "prepare": 0.01, "transfer": 0.0}, answers)
    assert (report.version, report.bytes, report.backends) == (3, 30, {"cuda_ipc": 3})
    assert report.profile["receiver_map"] == 0.003 and report.profile["receiver_copy"] == 0.002
    assert report.profile["prepare_rpc"] == pytest.approx(0.01 - 0.004) and "rpc" not in report.profile
    assert report.channels == ["cuda_ipc", "cuda_ipc"]


def test_a_mixed_fleet_publishes_to_the_others_only_and_counts_everyone():
    pulled = pb.Answer(backend=pb.BACKEND_CUDA_IPC, ranks=1, pull=True, stages={"copy": 0.002})
    pushed = pb.Answer(backend=pb.BACKEND_NCCL, ranks=1, stages={"check": 0.0005})
    assert _pushed([pulled, pushed]) == [pushed]
    pub = trainer_pb2.PublishWeightsResponse(version=3, bytes=30, seconds=0.004, backends={"nccl": 1},
                                             profile={"receiver_broadcast": 0.003})
    report = _report(OFFER, pub, {"prepare": 0.003, "transfer": 0.005}, [pulled, pushed])
    assert report.backends == {"nccl": 1, "cuda_ipc": 1}
    assert report.profile["rpc"] == pytest.approx(0.001) and report.profile["receiver_broadcast"] == 0.003
    assert report.profile["receiver_copy"] == 0.002 and report.profile["receiver_check"] == 0.0005


def test_a_sender_refuses_a_pull_answer_to_an_offer_that_described_no_memory():
    with WeightSender({"w": torch.zeros(4)}) as sender:
        offer = sender.offer(version=1)  # CPU, and no pull asked: nothing to map
        ans = answer(offer, "r")
        ans.pull = True
        with pytest.raises(FailedPrecondition, match="says it pulled"):
            sender.send(offer, [ans], timeout=5)


def test_a_pull_answered_before_its_copy_names_the_event_of_every_rank_that_queued_one():
    from rlsync.rollout.staging import pulled

    states = [{"state": "done", "stages": {"queue": 0.001}, "copied": b"event-0"},
              {"state": "done", "stages": {"copy": 0.002, "verify": 0.001}, "copied": b""}]  # held nothing: waited
    ans = pulled(pb.Answer(backend=pb.BACKEND_CUDA_IPC, ranks=2, pull=True), states)
    assert list(ans.copied) == [b"event-0"]  # the sender waits on this one before it frees its memory
    assert dict(ans.stages) == {"queue": 0.001, "copy": 0.002, "verify": 0.001}
