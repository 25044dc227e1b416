"""A broadcast's buckets go straight from the sender's memory into the receiver's where both lie
end to end there (flat weights); only the others pass through the group's staging slots, which are
made on that first need (a real gloo group between two threads of this process)."""

from __future__ import annotations

import threading

import torch

from rlsync.flat import FlatStore
from rlsync.transfer import WeightSender, answer, receive
from rlsync.transfer.backends import groups

SHAPES = {"embed": (64, 8), "norm": (8,), "head": (8, 64)}


def _flat() -> dict[str, torch.Tensor]:
    return FlatStore({n: (torch.Size(s), torch.float32) for n, s in SHAPES.items()}).views


def _slots(sessions) -> list[bool]:
    return [s.slots is not None for s in sessions]


def test_buckets_in_place_at_both_ends_stage_nothing_and_a_scattered_end_stages():
    source = _flat()
    for t in source.values():
        t.normal_()
    sender = WeightSender(source, bucket_bytes=1 << 10, backends=["gloo"])
    try:
        for version, dest in enumerate([_flat(), {n: torch.zeros(s) for n, s in SHAPES.items()}], start=1):
            offer = sender.offer(version)
            ans = answer(offer, f"r{version}", force="gloo")
            received = threading.Thread(target=receive, args=(offer, ans, dest), kwargs={"timeout": 30})
            received.start()
            sender.send(offer, [ans], timeout=30)
            received.join()
            assert all(torch.equal(dest[n], source[n]) for n in SHAPES)
            held = groups._HELD[next(reversed(groups._HELD))]  # this receiver's group, kept for reuse
            assert _slots([held]) == [version == 2], "flat: in place; separate tensors: through the slots"
            sessions = [v for v in sender.cache.values() if isinstance(v, groups._Session)]
            assert sessions and not any(_slots(sessions)), "the sender's flat weights go out in place"
    finally:
        sender.close()
        groups.release_held()
