"""rlsync.transfer.relaunch's rules: a kept launch goes again only for an offer naming the same memories,
manifest and rank, while the storages it read stay held as they were (the GPU test runs real ones:
tests/gpu/test_updates_gpu.py, the sharded trainer sharing the GPU)."""

from __future__ import annotations

import torch

from rlsync.transfer.held import HeldMappings
from rlsync.transfer.manifest import Spec
from rlsync.transfer.relaunch import relaunch, remember
from rlsync.transfer.v1 import transfer_pb2 as pb

CPU = torch.device("cpu")


def _held() -> HeldMappings:
    return HeldMappings(lambda handle, device: torch.zeros(4, dtype=torch.uint8))  # (stands in for a mapping)


def _routing(*digests: str) -> pb.Routing:
    return pb.Routing(store="127.0.0.1:1", layout="L", holder="trainer", memories=digests)


def test_a_kept_launch_goes_again_only_for_the_same_offer_while_its_storages_stay_held():
    held, kept = _held(), {}
    specs = [Spec("w", torch.bfloat16, (2, 2), 8)]
    held.hold("trainer", [b"a", b"b"], CPU)
    remember(kept, _routing("d0", "d1"), specs, 0, {"tables": (), "handles": (b"a", b"b")}, 8, held=held)

    assert relaunch(kept, _routing("d0", "d1"), list(specs), held=held) == 8
    assert relaunch(kept, _routing("d0", "d2"), specs, held=held) is None, "another memory (an onload)"
    assert relaunch(kept, _routing("d0", "d1"), [Spec("w", torch.bfloat16, (4,), 8)], held=held) is None
    assert relaunch(kept, _routing("d0", "d1"), specs, rank=1, held=held) is None, "another engine rank"
    assert relaunch({}, _routing("d0", "d1"), specs, held=held) is None, "another staging"

    held.hold("trainer", [b"a", b"b"], CPU)  # the same list again: the mappings stay as they were
    assert relaunch(kept, _routing("d0", "d1"), specs, held=held) == 8
    held.hold("trainer", [b"a", b"b", b"c"], CPU)  # another list: mapped anew, what was derived goes
    assert relaunch(kept, _routing("d0", "d1"), specs, held=held) is None
    held.release("trainer")
    assert relaunch(kept, _routing("d0", "d1"), specs, held=held) is None


def test_nothing_is_kept_for_storages_no_longer_held_and_a_later_pull_replaces_it():
    held, kept = _held(), {}
    specs = [Spec("w", torch.bfloat16, (2, 2), 8)]
    remember(kept, _routing("d0"), specs, 0, {"tables": (), "handles": (b"a",)}, 8, held=held)
    assert kept == {}, "not held: nothing to launch again"
    held.hold("trainer", [b"a"], CPU)
    remember(kept, _routing("d0"), specs, 0, {"tables": (), "handles": (b"a",)}, 8, held=held)
    remember(kept, _routing("d1"), specs, 0, {"tables": (), "handles": (b"a",)}, 8, held=held)
    assert len(kept) == 1, "one launch per staging: the latest"
    assert relaunch(kept, _routing("d0"), specs, held=held) is None
    assert relaunch(kept, _routing("d1"), specs, held=held) == 8
