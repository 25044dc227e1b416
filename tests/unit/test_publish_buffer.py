"""The trainer's publish buffer: what an offer copies the weights into, for replicas to pull while
training goes on (pulls need CUDA: tests/gpu/test_updates_gpu.py; here the copy itself, on CPU)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlsync.flat import FlatStore
from rlsync.publish.buffer import PublishBuffer
from rlsync.publish.core import PublisherCore, in_thread
from rlsync.transfer import WeightSender
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
        for step in range(2):  # the second refresh of a scattered source launches its kept table
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
    core = PublisherCore(lambda: ResidentSource(tensors), in_thread(asyncio.Lock()), bucket_bytes=1 << 20,
                         publish_buffer=True)
    try:
        offer, regions = asyncio.run(core.offer(1))
        assert not offer.mapped.ipc and regions is None and core._buffer is None
    finally:
        core.close()
