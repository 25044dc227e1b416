"""rlsync.transfer.relaunch's rules: a kept launch goes again only for an offer naming the same memories,
manifest and rank, while the storages it read stay held as they were (the GPU test runs real ones:
tests/gpu/test_updates_gpu.py, the sharded trainer sharing the GPU). The kernel launch is recorded, not run."""

from __future__ import annotations

import pytest
import torch

from rlsync.transfer import relaunch as relaunch_module
from rlsync.transfer.held import HeldMappings
from rlsync.transfer.manifest import Spec
from rlsync.transfer.relaunch import relaunch, remember
from rlsync.transfer.v1 import transfer_pb2 as pb

CPU = torch.device("cpu")
SPECS = [Spec("w", torch.bfloat16, (2, 2), 8)]
TABLES = ("table 1", "table 2")  # (stand-ins: batched.launch is recorded)


@pytest.fixture
def launched(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(relaunch_module.batched, "launch", calls.append)
    return calls


def _held() -> HeldMappings:
    return HeldMappings(lambda handle, device: torch.zeros(4, dtype=torch.uint8))  # (stands in for a mapping)


def _routing(*digests: str, layout: str = "L", holder: str = "trainer") -> pb.Routing:
    return pb.Routing(store="127.0.0.1:1", layout=layout, holder=holder, memories=digests)


def _remember(kept: dict, held: HeldMappings, routing: pb.Routing, handles=(b"a", b"b")) -> None:
    remember(kept, routing, SPECS, 0, {"tables": TABLES, "handles": handles}, 8, held=held)


def test_a_kept_launch_goes_again_for_the_same_offer_and_keeps_what_it_reads(launched):
    held, kept = _held(), {}
    held.hold("trainer", [b"a", b"b"], CPU)
    _remember(kept, held, _routing("d0", "d1"))
    assert launched == [], "remembering launches nothing"

    nbytes, reads = relaunch(kept, _routing("d0", "d1"), list(SPECS), held=held)
    assert nbytes == 8 and launched == list(TABLES), "its tables, in order"
    assert [t is held.get(h) for t, h in zip(reads, (b"a", b"b"))] == [True, True], "the mappings it reads"


@pytest.mark.parametrize("other", [
    dict(routing=_routing("d0", "d2")),  # another memory (the trainer's onload)
    dict(routing=_routing("d0", "d1", layout="L2")),  # another trainer layout
    dict(routing=_routing("d0", "d1", holder="other")),  # another holder
    dict(specs=[Spec("w", torch.bfloat16, (4,), 8)]),  # another manifest
    dict(rank=1),  # another engine rank
])
def test_an_offer_naming_anything_else_launches_nothing(launched, other):
    held, kept = _held(), {}
    held.hold("trainer", [b"a", b"b"], CPU)
    _remember(kept, held, _routing("d0", "d1"))
    assert relaunch(kept, other.get("routing", _routing("d0", "d1")), other.get("specs", SPECS),
                    rank=other.get("rank", 0), held=held) is None
    assert relaunch({}, _routing("d0", "d1"), SPECS, held=held) is None, "another staging"
    assert launched == []


def test_storages_held_anew_or_let_go_launch_nothing(launched):
    held, kept = _held(), {}
    held.hold("trainer", [b"a", b"b"], CPU)
    _remember(kept, held, _routing("d0", "d1"))
    held.hold("trainer", [b"a", b"b"], CPU)  # the same list again: the mappings stay as they were
    assert relaunch(kept, _routing("d0", "d1"), SPECS, held=held) is not None
    held.hold("trainer", [b"a", b"b", b"c"], CPU)  # another list: mapped anew, what was derived goes
    assert relaunch(kept, _routing("d0", "d1"), SPECS, held=held) is None
    _remember(kept, held, _routing("d0", "d1"))
    held.release("trainer")
    assert relaunch(kept, _routing("d0", "d1"), SPECS, held=held) is None
    assert launched == list(TABLES)


def test_nothing_is_kept_unheld_or_unnamed_and_a_later_pull_replaces_what_was(launched):
    held, kept = _held(), {}
    _remember(kept, held, _routing("d0"), handles=(b"a",))
    assert kept == {}, "not held: nothing to launch again"
    held.hold("trainer", [b"a"], CPU)
    _remember(kept, held, _routing(), handles=(b"a",))
    assert kept == {}, "an offer naming no memories: nothing to match the next one by"
    _remember(kept, held, _routing("d0"), handles=(b"a",))
    _remember(kept, held, _routing("d1"), handles=(b"a",))
    assert relaunch(kept, _routing("d0"), SPECS, held=held) is None
    assert relaunch(kept, _routing("d1"), SPECS, held=held)[0] == 8
