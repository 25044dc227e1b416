"""The trainer's publish buffer: what an offer copies the weights into, for replicas to pull while
training goes on (pulls need CUDA: tests/gpu/test_updates_gpu.py; here the copy itself, on CPU)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rlsync.errors import NotFound
from rlsync.flat import FlatStore
from rlsync.publish import core as publish_core
from rlsync.publish.buffer import PublishBuffer
from rlsync.publish.core import PublisherCore, in_thread
from rlsync.transfer import WeightSender, answer, receive
from rlsync.transfer.source import ResidentSource

SHAPES = {"embed": ((10, 4), torch.bfloat16), "norm": ((4,), torch.float32), "empty": ((0,), torch.bfloat16),
          "head": ((4, 10), torch.bfloat16)}


def flat() -> dict[str, torch.Tensor]:
    return FlatStore({n: (torch.Size(s), torch.bfloat16) for n, (s, _) in SHAPES.items()}).views


def scattered() -> dict[str, torch.Tensor]:
    return {n: torch.empty(s, dtype=d) for n, (s, d) in SHAPES.items()}


@pytest.mark.parametrize("make", [flat, scattered])
def test_the_buffer_holds_the_values_of_its_last_refresh(make):
    tensors = make()
    for i, t in enumerate(tensors.values()):
        t.copy_(torch.arange(t.numel()).view(t.shape) + i)
    buffer = PublishBuffer(ResidentSource(tensors), WeightSender)
    try:
        assert (buffer._whole is not None) == (make is flat)  # flat on both sides: one copy
        for step in range(2):  # (the kept launch table of a scattered source needs a GPU: tests/gpu)
            buffer.refresh()
            offered = {n: t.clone() for n, t in tensors.items()}
            for t in tensors.values():
                t.add_(1)  # the next training step: the buffer keeps what was offered
            assert all(torch.equal(buffer.store.views[n], offered[n]) for n in tensors), step
    finally:
        buffer.close()


def test_only_resident_contiguous_cuda_weights_get_a_buffer_and_without_one_an_offer_is_pushed():
    tensors = flat()
    assert not PublishBuffer.fits(ResidentSource(tensors))  # on CPU, receivers map shared memory instead
    core = PublisherCore(lambda _: ResidentSource(tensors), in_thread(asyncio.Lock()), bucket_bytes=1 << 20,
                         publish_buffer=True)
    try:
        offer, regions = asyncio.run(core.offer(1))
        assert not offer.mapped.ipc and regions is None and core._buffer is None
    finally:
        core.close()


def test_an_offer_of_the_buffer_sends_what_was_offered_and_a_newer_offer_retires_it(monkeypatch):
    """On CPU the buffer's offer is pushed (over shm), not pulled: what reaches the receiver is the
    weights as they were at the offer, whatever trained since."""
    monkeypatch.setattr(publish_core, "_why_no_buffer", lambda sender, delta: "")  # a buffer on CPU too
    tensors = scattered()
    for t in tensors.values():
        t.normal_()
    core = PublisherCore(lambda _: ResidentSource(tensors), in_thread(asyncio.Lock()), bucket_bytes=1 << 10,
                         publish_buffer=True)

    async def sync() -> None:
        old, _ = await core.offer(1)
        offer, _ = await core.offer(2)
        offered = {n: t.clone() for n, t in tensors.items()}
        for t in tensors.values():
            t.add_(1)  # a training step after the offer
        ans, dest = answer(offer, "r"), {n: torch.empty_like(t) for n, t in tensors.items()}
        received = threading.Thread(target=receive, args=(offer, ans, dest), kwargs={"timeout": 30})
        received.start()
        await core.publish(offer.transfer_id, [ans])
        received.join()
        assert all(torch.equal(dest[n], offered[n]) for n in tensors)
        with pytest.raises(NotFound, match="call OfferWeights"):  # its bytes were overwritten by offer 2's
            await core.publish(old.transfer_id, [answer(old, "r")])

    try:
        asyncio.run(sync())
        assert core._buffer is not None
        core.drop_sender()  # an offload: the buffer goes with the sender
        assert core._buffer is None and not core._offers
    finally:
        core.close()
