"""A pull queued before its offer, started by the sender on the GPU: no Python between the offer
and the copy.

A colocated replica that holds its trainer's memory (rlsync.transfer.held) and pulled from it
before knows, when its weights wake, what the next pull will copy: the same bytes of the held
storage into the same place in its weights. So it queues that copy at once (`Armed`), on a stream
of its own, behind a wait on a 4-byte word of its memory (its `Bell`, `cuStreamWaitValue32`), with an
event after it. The trainer maps the bell at its onload (HoldWeightsResponse.bell) and writes it on
a stream of its own once its weights are final, just before it rings the replica (`ring_bell`): the GPU
starts the copy there, while the ring's PrepareUpdate is on its way. The prepare adopts the copy
when the offer is the one it was armed for (`Armed.adopt`) and answers with the event, which
the trainer waits on as for any pull answered early (rlsync.transfer.copied).

A copy the replica does not adopt is disarmed: it writes its bell itself and waits for the copy,
whose bytes the weights' backup then overwrites before anything reads them (the hf engine); where there
is no backup (vLLM's woken weights), it is withdrawn: its table emptied first (zeros copied over its rows
from pinned memory, by a copy engine, not a kernel), so that a copy not yet started by the sender moves
nothing, and one that was makes the weights unfit to serve. Disarm before anything
that waits for the whole device (a synchronize, a cudaFree): a copy waiting on its bell would make
it wait forever.

What may run beside a copy waiting on a Bell (`bench/armed_hazards.py`, bench/results/armed-hazards-h100.json):
kernels loaded before it was armed run (an engine's decode steps, once warm); copies to the host, allocations
and stream synchronizes too. A launch that needs the whole device does not: a kernel's first launch (its module
loaded then, under CUDA's lazy loading; eager loading does not cover a cuBLAS kernel picked for a batch not
seen before), `empty_cache`, a device synchronize. It waits until the bell is written by another process, and
holds the driver meanwhile, so that a write launched by this one hangs too. A Bell is therefore armed only
where the replica launches nothing else until its update (between a colocated wake and the update it woke for).
A `HostBell` (rlsync.transfer.host_bell) lies in pinned host memory, which any thread of the replica writes by a
store of the CPU: what waited is then let go at once, and a copy armed behind one may wait beside generation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from google.protobuf.message import DecodeError

from rlsync.transfer import driver
from rlsync.transfer.memory import export_cuda, import_cuda, open_cuda
from rlsync.transfer.streams import own_stream
from rlsync.transfer.v1 import transfer_pb2 as pb


class Bell:
    """A replica's flag on its GPU (two 4-byte words: the value the trainer writes, and the value that
    started the armed copy, which the copy's stream records as it starts), the stream its armed copies
    wait on, and the handle a trainer maps the flag by. Made once per process and device (the
    trainer's mapping stays valid)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flag = torch.zeros(2, dtype=torch.int32, device=device)
        self.handle = pb.BellHandle(device=export_cuda(self.flag)).SerializeToString()
        self._started = self.flag[1:]  # where the armed stream copies the value that started it
        self._streams(device)

    def _streams(self, device: torch.device) -> None:
        self.stream = own_stream(device)  # (no other work may queue behind its wait)
        self.event = torch.cuda.Event(interprocess=True)  # recorded after each armed copy
        self.event_handle = self.event.ipc_handle()
        self._reader = own_stream(device)  # reads the flag without waiting for the engine's work
        self._read = torch.zeros(1, dtype=torch.int32, pin_memory=True)

    def write(self, value: int) -> None:
        """Starts what waits on the bell: a fill on this process's current stream (the armed one does not
        wait for it)."""
        self.flag[:1].fill_(value)

    def reset(self) -> None:
        self.flag.zero_()

    def capture(self, stream: torch.cuda.Stream) -> None:
        """Queues on `stream` the copy of the value written into the word that says what started what follows."""
        with torch.cuda.stream(stream):
            self._started.copy_(self.flag[:1])

    def holds(self) -> int | None:
        """The value written into the bell, as the CPU reads it now; None for a bell in GPU memory (a copy from it
        would wait behind what the bell holds up)."""
        return None

    def started_by(self) -> int:
        """The bell value that started the armed copy; 0 while it waits. (A later write of the bell
        does not change it: a copy started for an older offer stays told apart.)"""
        with torch.cuda.stream(self._reader):
            self._read.copy_(self._started, non_blocking=True)
        self._reader.synchronize()
        return int(self._read[0])


class Armed:
    """A copy queued to start when the bell is written (the sender's value, `offer.mapped.bell`, from 1
    up): `launch()` queues it on the current stream (here the bell's), `nbytes` is what it moves. `key`
    says which offer it copies (`key_of`, `routed_key`). What `launch()` returns (what the copy reads) is kept
    with it (`reads`)."""

    def __init__(self, bell: Bell, launch: Callable[[], object], nbytes: int, key: tuple,
                 cancel: Callable[[], object] | None = None):
        self.bell, self.key, self.nbytes, self.cancel = bell, key, nbytes, cancel
        bell.reset()
        torch.cuda.current_stream(bell.device).synchronize()  # zeroed, and the destination free, before the wait
        try:
            with torch.cuda.stream(bell.stream):
                driver.wait_value(bell.stream, bell.flag.data_ptr(), 1)
                bell.capture(bell.stream)  # what started it
                self.reads = launch()
                bell.event.record(bell.stream)
        except BaseException:  # a wait queued stays: released from this process's stream, what is behind it runs out
            bell.write(1)
            bell.stream.synchronize()
            raise
        self.done = False
        self.adopted = False  # an update took it: its bytes are the update's

    def adopt(self, specs, offer, start: bool = False) -> bool:
        """Takes the copy for `offer` (as rung: its PrepareUpdateRequest's), of `specs`, when it is that offer's:
        armed for its tensors, storages, locations and dtypes (`offer_key`), and started by the value the sender
        wrote for it (`offer.mapped.bell`; 0: it wrote none) or not started yet. A bell written with another value
        started the copy for an earlier offer, whose bytes may be older. `start`: one not started yet is started
        here, for a copy armed with no order against the sender's write (armed after it, it would wait for good)
        from weights that were final before the sender rang (a sharded trainer's ranks, once they described them)."""
        rung = offer.mapped.bell
        if self.done or self.adopted or rung <= 0 or offer_key(specs, offer) != self.key:
            return False
        by = self.bell.started_by()
        if by not in (0, rung):
            return False
        if by == 0 and start:
            self.bell.write(rung)
        self.adopted = True
        return True

    def withdraw(self) -> bool:
        """Disarms, the copy emptied first where it can be (`cancel`, run on this process's stream: the copy
        then moves nothing if it had not begun) -> whether it may have written its destination: the sender
        started it, or it could not be emptied. For a destination that must keep its values when no update
        takes the copy (an engine's live weights, with no backup to restore them from)."""
        if self.done:
            return True
        if self.cancel is not None:
            self.cancel()
            torch.cuda.current_stream(self.bell.device).synchronize()
        wrote = self.cancel is None or self.bell.started_by() != 0
        self.disarm()
        return wrote

    def disarm(self) -> None:
        """Lets the copy run, if the sender has not, and waits for it. Idempotent."""
        if self.done:
            return
        self.bell.write(1)
        self.bell.stream.synchronize()
        self.done = True


def key_of(specs, ipc, region, offset, dtype=()) -> tuple:
    """What makes two pulls the same copy: the tensors, the storages, where each tensor lies in them and
    in which dtype (a pull that casts); as an offer's MappedTensors says them."""
    return tuple(specs), tuple(ipc), tuple(region), tuple(offset), tuple(dtype)


def routed_key(specs, routing) -> tuple:
    """What makes two of a sharded trainer's offers the same copy into one store (rlsync.transfer.relaunch): the
    tensors, the trainer's layout, the holder its ranks' storages are held under and every rank's memory."""
    return "routed", tuple(specs), routing.layout, routing.holder, tuple(routing.memories)


def offer_key(specs, offer) -> tuple:
    """The copy an offer of `specs` is: a sharded trainer's naming its ranks' memories (`routed_key`), else a pull
    of the storages its MappedTensors map (`key_of`)."""
    if offer.routing.memories:
        return routed_key(specs, offer.routing)
    mapped = offer.mapped
    return key_of(specs, mapped.ipc, mapped.region, mapped.offset, mapped.dtype)


@lru_cache(maxsize=64)  # mapped once per replica, for as long as it lives; gone ones age out
def open_bell(handle: bytes, device: torch.device) -> torch.Tensor:
    """The trainer's side: a replica's bell (HoldWeightsResponse.bell: a BellHandle), its two words mapped for
    `device`'s streams to write (`ring_bell`)."""
    try:
        bell = pb.BellHandle.FromString(handle)
    except DecodeError:  # (a replica from before BellHandle: its CudaIpcHandle alone)
        return open_cuda(handle, device)
    if bell.HasField("host"):
        from rlsync.transfer.host_bell import open_host_words  # (it builds on Bell)

        return open_host_words(bell.host, device)
    if bell.HasField("device"):
        return import_cuda(bell.device, device)
    return open_cuda(handle, device)


@lru_cache(maxsize=None)
def ring_stream(index: int) -> torch.cuda.Stream:
    """The trainer's stream that writes bells on GPU `index` (`ring_bell`), its own: it waits for the weights of the
    offer it rings and for nothing else, such as training queued since on the trainer's stream."""
    return own_stream(torch.device("cuda", index))


def ring_bell(flag: torch.Tensor, value: int, after: torch.cuda.Event | None = None) -> None:
    """The trainer's side: writes `value` into a replica's mapped bell once the weights it offers are final on the
    GPU: after `after` (an event recorded as the offer was made: the publisher's `final`), else after everything
    queued on the current stream now. On `ring_stream`, fenced so that they are visible first.

    A stream write, not a kernel: with a kernel of the trainer's context in between, the replica's
    copy ends 0.27 ms later on an H100 (the GPU switching contexts; with the stream write, as soon
    as when the replica writes its own bell)."""
    stream = ring_stream(flag.device.index)
    with torch.cuda.device(flag.device):
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream())
        driver.write_value(stream, flag.data_ptr(), value)
