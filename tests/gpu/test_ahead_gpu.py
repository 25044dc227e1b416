"""NCCL broadcasts each end posts before the other is ready: the sender at its offer, a receiver on
another GPU as it prepares (rlsync.transfer.backends.groups), between real processes (GPU machine
with 2 GPUs only)."""

from __future__ import annotations

import pytest
import torch

from transfer_helpers import Peer

from rlsync.flat import FlatStore
from rlsync.transfer import WeightSender
from rlsync.transfer.checksum import checksum_tensor
from rlsync.transfer.peer import decode, encode
from rlsync.transfer.v1 import transfer_pb2 as pb

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda:0").manual_seed(step)
    shapes = {"embed": (512, 256), "w1": (1024, 1024), "norm": (1024,), "w2": (333, 77)}
    return {n: torch.randn(s, generator=g, device="cuda:0").to(torch.bfloat16) for n, s in shapes.items()}


class _Loop:
    """One receiver process on cuda:1 (--loop), and the sender here on cuda:0 over a flat copy of the
    weights, updated in place between transfers as a trainer's are."""

    def __init__(self, *peer_args: str, bucket_bytes: int = 1 << 20):
        weights = _weights(0)  # flat, as rlsync's trainer keeps them (or a publish buffer): buckets go in place
        self.tensors = FlatStore({n: (t.shape, t.dtype) for n, t in weights.items()}, torch.device("cuda:0")).views
        self.peer = Peer("receive", "--loop", "--backend", "nccl", "--device", "cuda:1", "--report-checksums",
                         *peer_args)
        self.sender = WeightSender(self.tensors, backends=["nccl"], bucket_bytes=bucket_bytes)

    def transfer(self, version: int, ahead: bool = True, cancel_first: bool = False) -> tuple[bool, dict]:
        for name, t in _weights(version).items():
            self.tensors[name].copy_(t)
        torch.cuda.synchronize()
        offer = self.sender.offer(version=version)
        started = self.sender.send_ahead(offer) if ahead else False
        if cancel_first:  # an offer abandoned after its broadcasts started: they end, and the next one goes
            self.sender.cancel_ahead(offer.transfer_id)
            offer = self.sender.offer(version=version)
        self.peer.send(encode(offer))
        self.sender.send(offer, [decode(pb.Answer, self.peer.line("ANSWER"))], timeout=120)
        result = self.peer.result(120)
        assert result["ok"], result
        assert result["checksums"] == {n: checksum_tensor(t) for n, t in self.tensors.items()}, f"version {version}"
        return started, result

    def close(self) -> None:
        self.sender.close()
        self.peer.kill()


def test_a_receiver_posts_as_it_prepares_and_takes_the_broadcasts_sent_ahead_of_its_answer():
    loop = _Loop()
    try:
        started, first = loop.transfer(1)
        assert not started and not first["adopted_posted"]  # no group yet: the first transfer forms it
        for version in (2, 3, 4):
            started, result = loop.transfer(version)
            assert started and result["adopted_posted"], (version, started, result)
    finally:
        loop.close()


def test_a_receiver_posts_for_a_sender_that_sends_only_once_it_has_the_answers():
    loop = _Loop("--bucket-bytes", str(1 << 19))  # the answers ask for smaller buckets than the offer's
    try:
        loop.transfer(1)
        for version in (2, 3):
            started, result = loop.transfer(version)
            assert not started and result["adopted_posted"], (version, result)
    finally:
        loop.close()


def test_nothing_is_posted_for_a_new_plan_and_the_group_after_it_is_posted_on_again():
    loop = _Loop()
    try:
        loop.transfer(1)
        loop.sender.bucket_bytes = 1 << 19  # another plan: the group is not reused, a new one is made
        started, result = loop.transfer(2)
        assert not started and not result["adopted_posted"]
        started, result = loop.transfer(3)
        assert started and result["adopted_posted"]
    finally:
        loop.close()


def test_an_offer_abandoned_after_its_broadcasts_started_leaves_the_next_transfer_whole():
    loop = _Loop()
    try:
        loop.transfer(1)
        started, result = loop.transfer(2, cancel_first=True)  # its group aborted: the receiver's posted one goes
        assert started and not result["adopted_posted"]
        started, result = loop.transfer(3)
        assert started and result["adopted_posted"]
    finally:
        loop.close()
