"""When a generating hf replica launches its last held pull again (Arming.launch), and when it lays
out a receiver instead: the decisions before any copy, on CPU. (The copy itself, and an abort after
it: tests/gpu/test_updates_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from rlsync.flat import FlatStore
from rlsync.rollout.engines import hf_armed
from rlsync.rollout.engines.hf_armed import Arming
from rlsync.transfer.held import HeldMappings
from rlsync.transfer.manifest import Spec
from rlsync.transfer.v1 import transfer_pb2 as pb

SHAPES = {"a": (4, 8), "b": (16,), "c": (2, 2)}
SPECS = [Spec(n, torch.bfloat16, s, torch.Size(s).numel() * 2) for n, s in SHAPES.items()]
NBYTES = sum(s.nbytes for s in SPECS)


class _Weights:
    """What launch() reads of hf_weights.Weights: the spare store, taken and put back."""

    def __init__(self, spare: FlatStore | None):
        self.spare = spare

    def take_spare(self):
        spare, self.spare = self.spare, None
        return spare

    def give_back_spare(self, store):
        if self.spare is None:
            self.spare = store


def _mapped(handles=(b"h0",), start: int = 0, waits: bool = True) -> pb.MappedTensors:
    offsets, at = [], start
    for s in SPECS:
        offsets.append(at)
        at += s.nbytes
    return pb.MappedTensors(ipc=list(handles), region=[0] * len(SPECS), offset=offsets, waits=waits)


@pytest.fixture
def held(monkeypatch):
    mappings = HeldMappings(opener=lambda handle, device: torch.zeros(NBYTES + 64, dtype=torch.uint8))
    monkeypatch.setattr(hf_armed, "HELD", mappings)
    mappings.hold("trainer", [b"h0"], torch.device("cpu"))
    return mappings


@pytest.fixture
def arming(held) -> Arming:
    arming = Arming(torch.device("cpu"))
    arming.learn(SPECS, _mapped())
    return arming


def _spare() -> FlatStore:
    return FlatStore({n: (torch.Size(s), torch.bfloat16) for n, s in SHAPES.items()})


def test_a_pull_learnt_is_one_run_of_one_storage(arming):
    assert arming.plan[3] == (0, 0, NBYTES)
    arming.learn(SPECS, pb.MappedTensors(ipc=[b"h0"], region=[0, 0, 0], offset=[0, 128, 64]))  # not back to back
    assert arming.plan is None


@pytest.mark.parametrize("why, change", [
    ("the sender does not wait on the GPU for the copy (prepared by gRPC)", lambda m: m.__setattr__("waits", False)),
    ("other places in the storage", lambda m: m.offset.__setitem__(0, 8)),
    ("a pull that casts", lambda m: m.dtype.extend(["float32"] * len(SPECS))),
    ("storages no holder holds as listed", lambda m: m.ipc.append(b"h1")),
])
def test_an_offer_that_is_not_the_last_pull_lays_out_a_receiver_and_leaves_the_spare(arming, why, change):
    weights, mapped = _Weights(_spare()), _mapped()
    change(mapped)
    spare = weights.spare
    assert arming.launch(weights, SPECS, mapped, version=2) is None, why
    assert weights.spare is spare, why


def test_other_tensors_or_no_plan_launch_nothing(held):
    weights = _Weights(_spare())
    assert Arming(torch.device("cpu")).launch(weights, SPECS, _mapped(), 2) is None  # nothing learnt yet
    arming = Arming(torch.device("cpu"), enabled=False)  # arm=false: nothing learnt, nothing launched
    arming.learn(SPECS, _mapped())
    assert arming.plan is None and arming.launch(weights, SPECS, _mapped(), 2) is None
    arming = Arming(torch.device("cpu"))
    arming.learn(SPECS, _mapped())
    other = [*SPECS[:2], Spec("c", torch.bfloat16, (4,), 8)]
    assert arming.launch(weights, other, _mapped(), 2) is None


def test_a_spare_laid_out_otherwise_goes_back(arming):
    odd = FlatStore({"a": (torch.Size((4, 8)), torch.bfloat16), "b": (torch.Size((16,)), torch.float32)})
    weights = _Weights(odd)
    assert arming.launch(weights, SPECS, _mapped(), 2) is None
    assert weights.spare is odd
    weights = _Weights(None)  # dropped for generation's room: a receiver allocates staging
    assert arming.launch(weights, SPECS, _mapped(), 2) is None and weights.spare is None


def test_a_storage_smaller_than_the_run_launches_nothing(arming, held):
    held.hold("trainer", [b"small"], torch.device("cpu"))  # (the opener makes NBYTES + 64: start past it)
    arming.learn(SPECS, _mapped((b"small",), start=128))
    weights = _Weights(_spare())
    assert arming.launch(weights, SPECS, _mapped((b"small",), start=128), 2) is None
    assert weights.spare is not None


def test_the_last_pull_again_reaches_the_copy_and_a_failed_launch_gives_the_spare_back(arming):
    """Everything matches: launch() goes as far as the copy, which needs CUDA (here it fails, as a
    sticky CUDA error would): the spare it took is put back for the receiver the caller lays out. (How it
    fails without CUDA depends on what this process imported before: torch's own AssertionError, or a
    ValueError for a CPU device once vLLM's CPU platform has set up torch.cuda's streams.)"""
    weights = _Weights(_spare())
    spare = weights.spare
    with pytest.raises((RuntimeError, AssertionError, ValueError)):
        arming.launch(weights, SPECS, _mapped(), 2)
    assert weights.spare is spare
