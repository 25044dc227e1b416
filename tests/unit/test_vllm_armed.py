"""Which offers are the copy a vLLM worker armed at a wake (vllm_armed): pure logic on the protos."""

from __future__ import annotations

import pytest

from rlsync.rollout.engines.vllm_armed import adopted, unlike
from rlsync.transfer.v1 import transfer_pb2 as pb

HELD = [b"storage-a", b"storage-b"]


def _offer(**change) -> pb.Offer:
    """The armed pull's offer as the next ring sends it: the storages held now, its bell value."""
    offer = pb.Offer(manifest=pb.Manifest(version=7, tensors=[
        pb.TensorSpec(name="a", dtype="bfloat16", shape=[4, 8], nbytes=64),
        pb.TensorSpec(name="b", dtype="bfloat16", shape=[8], nbytes=16)]),
        mapped=pb.MappedTensors(ipc=HELD, region=[0, 1], offset=[0, 512], waits=True, bell=3))
    for path, value in change.items():
        *parents, field = path.split("__")
        message = offer
        for name in parents:
            message = getattr(message, name)
        if isinstance(value, list):
            del getattr(message, field)[:]
            getattr(message, field).extend(value)
        else:
            setattr(message, field, value)
    return offer


def _armed() -> pb.Offer:
    """The pull the worker armed from: an earlier version, from the storages of the trainer's last onload."""
    return _offer(manifest__version=6, mapped__ipc=[b"old-a", b"old-b"], mapped__bell=0, mapped__waits=False)


def test_the_next_ring_of_the_same_tensors_from_the_same_places_of_the_storages_held_is_the_armed_copy():
    assert unlike(_offer(), _armed(), HELD, "") == ""
    assert unlike(_offer(), _armed(), HELD, "cuda_ipc") == ""


@pytest.mark.parametrize("change, force, why", [
    ({"mapped__bell": 0}, "", "rang no bell"),
    ({"mapped__waits": False}, "", "rang no bell"),
    ({}, "nccl", "a backend forced (nccl)"),
    ({"mapped__ipc": [b"storage-b", b"storage-a"]}, "", "other storages"),
    ({"mapped__ipc": HELD[:1]}, "", "other storages"),
    ({"mapped__offset": [0, 1024]}, "", "other places"),
    ({"mapped__region": [1, 0]}, "", "other places"),
    ({"mapped__dtype": ["float32", "float32"]}, "", "other places"),
    ({"manifest__tensors": [pb.TensorSpec(name="a", dtype="bfloat16", shape=[4, 8], nbytes=64)]}, "", "other tensors"),
    ({"manifest__tensors": [pb.TensorSpec(name="a", dtype="bfloat16", shape=[4, 8], nbytes=64, checksum="x"),
                            pb.TensorSpec(name="b", dtype="bfloat16", shape=[8], nbytes=16)]}, "", "other tensors"),
])
def test_any_other_offer_is_pulled_as_usual_and_says_why(change, force, why):
    assert why in unlike(_offer(**change), _armed(), HELD, force)


def test_an_adapter_or_a_routed_offer_is_never_the_armed_copy():
    lora = _offer()
    lora.manifest.adapter.rank = 8
    routed = _offer()
    routed.routing.SetInParent()
    assert all("adapter" in unlike(o, _armed(), HELD, "") for o in (lora, routed))


def test_the_adopting_answer_is_the_armed_pulls_for_this_receiver_naming_only_the_copys_event():
    armed = pb.Answer(transfer_id="t6", receiver_id="before", backend=pb.BACKEND_CUDA_IPC, pull=True,
                      copied=[b"old-event"], stages={"map": 0.1})
    out = adopted(armed, "t7", "r0", b"bell-event")
    assert (out.transfer_id, out.receiver_id, out.backend, out.pull, list(out.copied), dict(out.stages)) == \
        ("t7", "r0", pb.BACKEND_CUDA_IPC, True, [b"bell-event"], {})
    assert armed.receiver_id == "before" and list(armed.copied) == [b"old-event"]  # (its own, untouched)
