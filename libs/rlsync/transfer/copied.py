"""A pull's copy confirmed on the GPU rather than by its answer (MappedTensors.waits).

A receiver that keeps the sender's memory mapped (a hold) queues its copy, records `copy_event`
after it and answers at once with the event's IPC handle (Answer.copied). The sender waits on that
event (`wait_copied`) before it writes or frees the memory. The answer's trip back and the
receiver's bookkeeping then overlap the copy instead of following it, and neither process wakes
the other when the bytes land.

Pulls on one device are queued on that device's transfer stream (rlsync.transfer.streams) in the
order they run (an engine prepares one update at a time), so one event per device serves them all:
its latest record is after every copy queued so far. Opened events are kept on the sender's side, so a replica's event
is opened once, not at every update.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from functools import cache, lru_cache

import torch

from rlsync.errors import Aborted, DeadlineExceeded
from rlsync.transfer.v1 import transfer_pb2 as pb


@cache
def copy_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """This process's event recorded after each pull it answers early on `device`, and its handle
    (made on `device`, whichever device the calling thread has current)."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        return event, event.ipc_handle()


def record_copied(device: torch.device) -> bytes:
    """Records the event after everything queued so far on `device`'s current stream (the transfer
    stream, in a pull) -> its handle."""
    event, handle = copy_event(device)
    event.record(torch.cuda.current_stream(device))
    return handle


@lru_cache(maxsize=64)  # a receiver's event stays open for as long as it lives (one each)
def _opened(device: int, handle: bytes) -> torch.cuda.Event:
    return torch.cuda.Event.from_ipc_handle(device, handle)


def sender_device(mapped: pb.MappedTensors, facts: pb.Facts | None = None) -> int:
    """The sender's index of the GPU its mapped memory (and so every puller's event) is on; with none named (a
    routed offer's pulls, Routing.memories), the one of its `facts` (the offer's), else this process's current
    one."""
    if mapped.ipc:
        return pb.CudaIpcHandle.FromString(mapped.ipc[0]).device
    if facts is not None and facts.gpu_uuids:
        return _index_of(facts.gpu_uuids[0])
    return torch.cuda.current_device()


@cache
def _index_of(uuid: str) -> int:
    """This process's index of the GPU of `uuid` (its current one when it sees no such GPU)."""
    from rlsync.transfer.handshake import gpu_uuid

    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(torch.device("cuda", i)) == uuid),
                torch.cuda.current_device())


async def wait_copied(handles: Iterable[bytes], device: int, timeout: float, who: str) -> float:
    """Returns once the GPU has passed every event -> seconds waited. It polls between turns of the
    event loop rather than blocking it: a copy takes milliseconds, a thread hop back costs a tenth
    of one."""
    start = time.perf_counter()
    events = [_opened(device, h) for h in handles]
    try:
        while not all(e.query() for e in events):
            if time.perf_counter() - start > timeout:
                raise DeadlineExceeded(f"{who}: its copy did not complete within {timeout:.0f}s")
            await asyncio.sleep(0)
    except RuntimeError as e:  # the GPU reports a fault in the copy, or the event's process is gone
        raise Aborted(f"{who}: waiting for its copy failed: {e}") from None
    return time.perf_counter() - start
