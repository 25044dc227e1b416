"""The stream a receiving end works on: its own, not the engine's.

An engine generates on its device's default stream while an update arrives in the background. Work
queued on that same stream runs in order with every decode kernel the engine queued before it, and a
collective's stream waits for the caller's stream at each call: a broadcast's buckets, a pull's
copy, the checksums would each wait their turn behind generation. On a stream of its own the
transfer runs beside it (NCCL's kernels run on its group's stream, ordered by this one).

`handed_over(device)` is taken where the caller hands the destination over: an event after what its
stream holds then (a fresh staging copy may reuse memory that kernels queued before still touch),
and that stream. `on_transfer_stream(device, handed)` runs the block on the transfer stream after
that event; afterwards the caller's stream waits for the transfer stream, on the GPU: whatever it
queues next sees the bytes, a copy only queued (a held pull) too.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch

from rlsync.transfer import driver

Handed = tuple[torch.cuda.Event, torch.cuda.Stream] | None


def resolved(device: torch.device) -> torch.device:
    """`device` with its index: a bare "cuda" means this thread's current device, which another
    thread (the one that runs the transfer) may not share."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def transfer_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's transfer stream on `device`: high priority, since a trainer waits on it."""
    return _stream(resolved(device).index)


@cache
def _stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index, priority=-1)


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A stream of this caller's alone on `device` (rlsync.transfer.driver.new_stream: none of torch's pool, whose
    streams other takers share), for work queued behind a wait that may last (a bell's), and what writes it."""
    index = resolved(device).index
    return torch.cuda.ExternalStream(driver.new_stream(index), device=torch.device("cuda", index))


def handed_over(device: torch.device) -> Handed:
    """The calling thread's stream on `device`, and an event after everything it holds now (None off
    CUDA)."""
    if device.type != "cuda":
        return None
    caller = torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    event.record(caller)
    return event, caller


@contextmanager
def on_transfer_stream(device: torch.device, handed: Handed):
    if device.type != "cuda" or handed is None:
        yield
        return
    ready, caller = handed
    stream = transfer_stream(device)
    stream.wait_event(ready)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)
