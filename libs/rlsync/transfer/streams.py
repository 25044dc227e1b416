"""The stream a receiving end works on: its own, not the engine's.

An engine generates on its device's default stream while an update arrives in the background. Work
queued on that same stream runs in order with every decode kernel the engine queued before it, and a
collective's stream waits for the caller's stream at each call: a broadcast's buckets, a pull's
copy, the checksums would each wait their turn behind generation. On a stream of its own the
transfer runs beside it.

`on_transfer_stream(device, ready)` runs the block there. The stream first waits for `ready`, an
event recorded where the caller handed the destination over (a fresh staging copy may reuse memory
that kernels queued before still touch), and afterwards the caller's stream waits for the stream,
on the GPU: whatever the caller queues next sees the bytes, a copy only queued (a held pull) too.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's transfer stream on `device`: high priority, since a trainer waits on it."""
    return _stream(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index, priority=-1)


def handed_over(device: torch.device) -> torch.cuda.Event | None:
    """An event after everything the calling thread's stream holds now (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextmanager
def on_transfer_stream(device: torch.device, ready: torch.cuda.Event | None):
    if device.type != "cuda":
        yield
        return
    caller, stream = torch.cuda.current_stream(device), transfer_stream(device)
    if ready is not None:
        stream.wait_event(ready)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)
