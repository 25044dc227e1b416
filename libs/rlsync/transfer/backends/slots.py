"""Same-host channels through mapped memory: `shm` (CPU, memfd) and `cuda_ipc` (same GPU).

Staged: the sender packs each bucket into one of two slots (double buffering) that every receiver
maps; a receiver copies the bucket out and frees the slot. One-copy: the sender's tensors already
live in mappable memory (a SharedArena on CPU, any CUDA storage on GPU), so each receiver maps
them and copies every tensor exactly once — the physical limit of a device-to-device copy.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable
from functools import cached_property

import torch

from rlsync.errors import DataLoss, FailedPrecondition
from rlsync.transfer import batched
from rlsync.transfer.backends.base import ReceiveJob, SendJob, collect_results, expect, report_failure, sync
from rlsync.transfer.checksum import checksum_bytes
from rlsync.transfer.copied import record_copied
from rlsync.transfer.dtypes import dtype_of, itemsize
from rlsync.transfer.held import HELD
from rlsync.transfer.memory import SharedBuffer, open_cuda, share_cuda
from rlsync.transfer.messages import Done, Events, Freed, Ready, Result, Welcome
from rlsync.transfer.spans import copy_all
from rlsync.transfer.v1 import transfer_pb2 as pb

SLOTS = 2


class _Mapped(abc.ABC):
    """The staged and one-copy protocols; subclasses say how memory is shared."""

    local = True
    backend: int

    @abc.abstractmethod
    def make_slots(self, job: SendJob, nbytes: int) -> tuple[list[torch.Tensor], dict, list[int]]:
        """Sender: SLOTS buffers of nbytes, the Welcome fields and descriptors that describe them."""

    @abc.abstractmethod
    def open_slots(self, job: ReceiveJob) -> list[torch.Tensor]:
        """Receiver: maps the slots the Welcome describes."""

    @abc.abstractmethod
    def regions(self, job: SendJob) -> tuple[dict, list[int]]:
        """Sender, one-copy: Welcome fields and descriptors of the memory its tensors live in."""

    @abc.abstractmethod
    def open_regions(self, job: ReceiveJob) -> list[torch.Tensor]:
        """Receiver, one-copy: maps those regions."""

    # Ordering of slot use between the two processes. Plain memory: copies are complete when
    # they return (after a sync), and the messages alone order them. CUDA overrides these with
    # IPC events, so neither process ever blocks on the GPU in the loop.
    def peer_events(self, job: SendJob) -> list | None:
        return None

    def own_events(self, job: ReceiveJob) -> list | None:
        return None

    def before_pack(self, job: SendJob, slot: int, peers) -> None:  # noqa: B027 - deliberately empty
        """The Freed messages already ordered this slot's reuse."""

    def after_pack(self, job: SendJob, slot: int) -> None:
        sync(job.device)

    def before_unpack(self, job: ReceiveJob, slot: int) -> None:  # noqa: B027 - deliberately empty
        """The Ready message already says the slot is packed."""

    def after_unpack(self, job: ReceiveJob, slot: int, own) -> None:
        sync(job.device)

    # -- sender ---------------------------------------------------------------------------------
    def send(self, job: SendJob) -> None:
        if job.one_copy:
            fields, fds = self.regions(job)
            for conn, _ in job.conns:
                conn.send(Welcome(backend=self.backend, bucket_bytes=job.bucket_bytes, one_copy=True, **fields), fds)
        else:
            self._send_staged(job)
        collect_results(job)

    def _send_staged(self, job: SendJob) -> None:
        slot_bytes = max(b.nbytes for b in job.plan) if job.plan else 1
        slots, fields, fds = self.make_slots(job, slot_bytes)
        for conn, _ in job.conns:
            conn.send(Welcome(backend=self.backend, bucket_bytes=job.bucket_bytes, slot_bytes=slot_bytes,
                              slots=SLOTS, **fields), fds)
        peers = self.peer_events(job)
        in_slot: list[int | None] = [None] * SLOTS
        for bucket in job.plan:
            slot = bucket.index % SLOTS
            if in_slot[slot] is not None:
                self._await_freed(job, in_slot[slot])
                self.before_pack(job, slot, peers)
            view = slots[slot]
            copy_all((job.sources[s.tensor][s.src:s.src + s.length], view[s.dst:s.dst + s.length])
                     for s in bucket.slices)
            self.after_pack(job, slot)
            cs = checksum_bytes(view[:bucket.nbytes]) if job.verify else ""
            for conn, _ in job.conns:
                conn.send(Ready(bucket.index, slot, cs))
            in_slot[slot] = bucket.index
        for pending in sorted(b for b in in_slot if b is not None):
            self._await_freed(job, pending)
        for conn, _ in job.conns:
            conn.send(Done())

    @staticmethod
    def _await_freed(job: SendJob, bucket: int) -> None:
        for conn, hello in job.conns:
            msg, _ = expect(conn, Freed, job.deadline, f"waiting for {hello.receiver_id} to free bucket {bucket}")
            if msg.bucket != bucket:
                raise DataLoss(f"{hello.receiver_id} freed bucket {msg.bucket}, expected {bucket}")

    # -- receiver -------------------------------------------------------------------------------
    def receive(self, job: ReceiveJob) -> None:
        try:
            if job.welcome.one_copy:
                self._receive_one_copy(job)
            else:
                self._receive_staged(job)
            nbytes = self._finish(job)
        except Exception as exc:
            report_failure(job.conn, exc)
            raise
        job.conn.send(Result(ok=True, nbytes=nbytes, stages=job.clock.stages))

    def pull(self, job: ReceiveJob, queued: bool = False) -> tuple[int, bytes]:
        """One-copy without the sender: the offer described its memory (job.welcome is made from
        it), so the receiver maps it and copies every tensor by itself; no connection, no messages.
        -> (bytes, b""), or with `queued` (the sender waits for the copy itself: MappedTensors.waits)
        and memory that stays mapped, (bytes, the handle of a CUDA event after the copy) as soon as
        the copy is queued."""
        regions = self.write_one_copy(job)
        if queued and job.scratch.get("held"):  # nothing to close after the copy: no need to wait for it
            job.clock.lap("queue")
            nbytes = job.writer.finish()
            return nbytes, record_copied(job.device)
        job.clock.lap("launch")  # the copies queued: beyond it, the GPU's time
        sync(job.device)
        job.clock.lap("copy")
        del regions  # mappings opened for this pull close now, after the copy ("release")
        return self._finish(job), b""

    @staticmethod
    def _finish(job: ReceiveJob) -> int:
        job.clock.lap("release")  # the mappings close as they go out of scope
        nbytes = job.writer.finish()
        sync(job.device)
        job.clock.lap("verify")
        return nbytes

    def _receive_staged(self, job: ReceiveJob) -> None:
        slots = self.open_slots(job)
        job.clock.lap("map")
        own = self.own_events(job)
        for bucket in job.plan:
            msg, _ = expect(job.conn, Ready, job.deadline, f"waiting for bucket {bucket.index + 1}/{len(job.plan)}")
            if msg.bucket != bucket.index:
                raise DataLoss(f"sender sent bucket {msg.bucket}, expected {bucket.index}")
            self.before_unpack(job, msg.slot)
            view = slots[msg.slot]
            if msg.checksum and checksum_bytes(view[:bucket.nbytes]) != msg.checksum:
                raise DataLoss(f"bucket {bucket.index} arrived corrupted (checksum mismatch): "
                               "the destination must not be used")
            job.writer.write_many([(s.tensor, s.src, view[s.dst:s.dst + s.length]) for s in bucket.slices])
            self.after_unpack(job, msg.slot, own)
            job.conn.send(Freed(bucket.index))
        expect(job.conn, Done, job.deadline, "waiting for the end of the transfer")
        sync(job.device)
        job.clock.lap("copy")

    def _receive_one_copy(self, job: ReceiveJob) -> None:
        regions = self.write_one_copy(job)  # noqa: F841 - mapped until the copy is done
        sync(job.device)
        job.clock.lap("copy")

    def write_one_copy(self, job: ReceiveJob) -> list:
        """Queues the copy of every tensor out of the sender's regions -> the regions (mapped)."""
        regions = self.open_regions(job)
        job.clock.lap("map")
        if len(job.welcome.locations) != len(job.specs):
            raise DataLoss(f"sender described {len(job.welcome.locations)} tensors, manifest has {len(job.specs)}")
        kind = "cast" if job.welcome.dtypes else "copy"
        where, bases = None, []
        if batched.available(job.device):  # (a kept table is a kernel launch's: none to key elsewhere)
            where, bases = _where(job, regions)
            if job.writer.write_rebased(kind, where, bases):  # the same layout as a pull before, mapped anew
                return regions
        layout = self._layout(job, regions)
        if job.welcome.dtypes:  # in another dtype at the sender: cast as copied
            job.writer.write_cast(layout.typed(job.welcome.dtypes), layout.plans)
        elif layout.whole is not None and job.writer.whole is not None:  # flat on both sides: one copy
            region, start, nbytes = layout.whole
            job.writer.write_whole(regions[region][start:start + nbytes])
        else:
            job.writer.write_all(layout.sources, layout.plans)
        if where is not None:
            job.writer.keep_rebased(kind, where, bases)
        return regions

    def repeat(self, job: ReceiveJob) -> tuple[Callable[[], None], Callable[[], None] | None] | None:
        """A pull made before from held storages, as one launch to queue later (rlsync.transfer.armed) ->
        (launch, cancel: what makes that launch copy nothing while it has not begun, or None). One copy where
        both sides lie back to back, else its kept table (DestWriter.keep_rebased) moved to the regions
        mapped now, uploaded and waited for here, its own copy of the rows (which `cancel` empties). The
        launch then queues one copy and nothing else: behind a wait on a bell, anything that waits for
        the stream would wait forever. None where that pull was neither (no Triton, or not one launch)."""
        if job.device.type != "cuda" or len(job.welcome.locations) != len(job.specs):
            return None
        regions = self.open_regions(job)
        if not job.scratch.get("held"):
            return None
        layout = self._layout(job, regions)
        if not job.welcome.dtypes and layout.whole is not None and job.writer.whole is not None:
            region, start, nbytes = layout.whole
            source = regions[region][start:start + nbytes]
            return (lambda: job.writer.write_whole(source)), None
        kept = job.writer.rebased_table("cast" if job.welcome.dtypes else "copy", *_where(job, regions)) \
            if batched.available(job.device) else None
        if kept is None:
            return None
        # Rows of its own (the kept table launches later pulls), and zeros to empty them with: a copy from pinned
        # memory, which a copy engine runs beside a stream waiting on a bell (a kernel may not: rlsync.transfer.armed)
        table = kept._replace(rows=kept.rows.clone())
        zeros = torch.zeros(table.rows.shape, dtype=table.rows.dtype).pin_memory()
        torch.cuda.current_stream(job.device).synchronize()  # its rows are on the GPU before anything waits
        # (from held mappings: their holder keeps them open)
        return (lambda: batched.launch(table)), (lambda: table.rows.copy_(zeros, non_blocking=True))

    @staticmethod
    def _layout(job: ReceiveJob, regions: list[torch.Tensor]) -> _Layout:
        """Where the tensors lie in the regions, kept for as long as the regions stay held
        (HeldMappings.memo): a repeat pull looks at no tensor and cuts no view again; else made at
        every transfer."""
        memo = job.scratch.get("memo")
        if memo is None and job.scratch.get("held"):
            memo = HELD.memo(job.welcome.ipc)
        if memo is None:  # (its plans go with it, but a one-launch table is kept rebased: DestWriter.keep_rebased)
            return _Layout(job.specs, job.welcome.locations, regions, {})
        kept = memo.setdefault("layouts", [])
        found = next((layout for layout in kept if layout.serves(job.specs, job.welcome.locations, regions)), None)
        if found is None:
            if len(kept) >= 8:  # layouts come and go (a LoRA adapter, a delta): keep the latest few
                kept.pop(0)
            found = _Layout(job.specs, job.welcome.locations, regions, {})
            kept.append(found)
        return found


def _where(job: ReceiveJob, regions: list[torch.Tensor]) -> tuple[tuple, list[int]]:
    """(what a kept one-launch table of this pull is keyed by besides its destinations, the regions'
    addresses it is moved to: DestWriter.write_rebased)."""
    where = (tuple(job.specs), tuple(job.welcome.dtypes), tuple(map(tuple, job.welcome.locations)),
             tuple(r.numel() for r in regions))
    return where, [r.data_ptr() for r in regions]


class _Layout:
    """What a pull derives from the regions and the tensors' locations in them: whether they lie back
    to back in one (`whole`: region, start, bytes), else each tensor's bytes (`sources`) or elements in
    the sender's dtypes (`typed`, a pull that casts); and `plans`, a dict for what the writer derives
    from those (DestWriter.write_all / write_cast), kept with the layout while the regions are held.
    Used by one thread at a time (a replica's pulls run on its engine thread)."""

    def __init__(self, specs, locations, regions: list[torch.Tensor], plans: dict):
        self.specs, self.locations, self.regions = specs, locations, regions
        self.whole = contiguous(specs, locations)
        if self.whole is not None:
            self._bytes("the tensors", *self.whole)  # inside its region
        self.plans = plans
        self._kinds = [(s.nbytes, s.dtype) for s in specs]
        self._typed: tuple[tuple[str, ...], list] | None = None

    def serves(self, specs, locations, regions: list[torch.Tensor]) -> bool:
        """Whether a pull of `specs` from `locations` of `regions` is this layout's: the same mappings,
        the same places, tensors of the same sizes and dtypes."""
        same = regions is self.regions or (len(regions) == len(self.regions)
                                           and all(map(operator.is_, regions, self.regions)))
        return same and locations == self.locations and (
            specs == self.specs or [(s.nbytes, s.dtype) for s in specs] == self._kinds)

    def _bytes(self, name: str, region: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of a region; DataLoss when they do not lie inside one."""
        if not 0 <= region < len(self.regions) or offset < 0 or offset + nbytes > self.regions[region].numel():
            raise DataLoss(f"{name!r}: {nbytes} bytes at byte {offset} of region {region} lie outside the "
                           f"{len(self.regions)} region(s) the offer maps")
        return self.regions[region][offset:offset + nbytes]

    def typed(self, dtypes: list[str]) -> list[torch.Tensor | None]:
        """Every tensor as it lies in the regions, in `dtypes` (one name each), flat; None for an empty
        one. Kept per list of dtypes, as `sources` is."""
        key = tuple(dtypes)
        if self._typed is None or self._typed[0] != key:
            out = []
            for spec, name, (region, offset) in zip(self.specs, dtypes, self.locations):
                dtype = dtype_of(name)
                count = spec.nbytes // itemsize(spec.dtype) if spec.nbytes else 0
                if not count:
                    out.append(None)
                    continue
                if offset % itemsize(dtype):
                    raise DataLoss(f"{spec.name!r}: byte {offset} of region {region} is no {name} element's start")
                out.append(self._bytes(spec.name, region, offset, count * itemsize(dtype)).view(dtype))
            self._typed = key, out
        return self._typed[1]

    @cached_property
    def sources(self) -> list[tuple[torch.Tensor, int] | None]:
        """(bytes, storage pointer) of every tensor, None for an empty one."""
        bases = [r.untyped_storage().data_ptr() for r in self.regions]
        return [(self._bytes(spec.name, region, offset, spec.nbytes), bases[region]) if spec.nbytes else None
                for spec, (region, offset) in zip(self.specs, self.locations)]


class ShmChannel(_Mapped):
    backend = pb.BACKEND_SHM

    def make_slots(self, job, nbytes):
        key = ("shm", nbytes)
        if key not in job.cache:
            job.cache[key] = SharedBuffer(nbytes * SLOTS)
        buf = job.cache[key]
        return [buf.tensor[i * nbytes:(i + 1) * nbytes] for i in range(SLOTS)], {}, [buf.fd]

    def open_slots(self, job):
        if len(job.fds) != 1:
            raise FailedPrecondition(f"expected one shared-memory descriptor from the sender, got {len(job.fds)}")
        n = job.welcome.slot_bytes
        buf = SharedBuffer.attach(job.fds[0], n * job.welcome.slots)
        return [buf.tensor[i * n:(i + 1) * n] for i in range(job.welcome.slots)]

    def regions(self, job):
        key = ("shm-regions", tuple(t.data_ptr() for t in job.sources))
        if key not in job.cache:
            job.cache[key] = [job.arena.locate(t) if s.nbytes else (0, 0) for t, s in zip(job.sources, job.specs)]
        return ({"regions": [b.nbytes for b in job.arena.buffers], "locations": job.cache[key]},
                [b.fd for b in job.arena.buffers])

    def open_regions(self, job):
        sizes = job.welcome.regions
        if len(job.fds) != len(sizes):
            raise FailedPrecondition(f"expected {len(sizes)} shared-memory descriptors, got {len(job.fds)}")
        return [SharedBuffer.attach(fd, n).tensor for fd, n in zip(job.fds, sizes)]


class CudaIpcChannel(_Mapped):
    backend = pb.BACKEND_CUDA_IPC

    def make_slots(self, job, nbytes):
        key = ("cuda", job.device, nbytes)
        if key not in job.cache:
            job.cache[key] = [torch.empty(nbytes, dtype=torch.uint8, device=job.device) for _ in range(SLOTS)]
            job.cache[("cuda-events", job.device)] = [
                torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        slots, events = job.cache[key], job.cache[("cuda-events", job.device)]
        job.scratch["packed"] = events
        return slots, {"ipc": [share_cuda(s, job.cache) for s in slots],
                       "events": [e.ipc_handle() for e in events]}, []

    def open_slots(self, job):
        job.scratch["packed"] = [torch.cuda.Event.from_ipc_handle(job.device, h) for h in job.welcome.events]
        return [open_cuda(raw, job.device) for raw in job.welcome.ipc]

    def peer_events(self, job):
        peers = []
        for conn, hello in job.conns:
            msg, _ = expect(conn, Events, job.deadline, f"waiting for {hello.receiver_id}'s slot events")
            peers.append([torch.cuda.Event.from_ipc_handle(job.device, h) for h in msg.handles])
        return peers

    def own_events(self, job):
        own = [torch.cuda.Event(interprocess=True) for _ in range(job.welcome.slots)]
        job.conn.send(Events([e.ipc_handle() for e in own]))
        return own

    def before_pack(self, job, slot, peers):
        stream = torch.cuda.current_stream(job.device)
        for events in peers:  # every receiver has copied the slot out
            stream.wait_event(events[slot])

    def after_pack(self, job, slot):
        job.scratch["packed"][slot].record(torch.cuda.current_stream(job.device))

    def before_unpack(self, job, slot):
        torch.cuda.current_stream(job.device).wait_event(job.scratch["packed"][slot])

    def after_unpack(self, job, slot, own):
        own[slot].record(torch.cuda.current_stream(job.device))

    def regions(self, job):
        return describe_cuda(job.sources, job.cache), []

    def open_regions(self, job):
        # Storages their owner asked this process to keep mapped are open already (rlsync.transfer.held);
        # a receiver told to hold them keeps this transfer's open for the next (closing those not listed).
        if job.hold:
            HELD.hold(job.hold, job.welcome.ipc, job.device)
        found = HELD.lookup(job.welcome.ipc)
        if found is not None:  # exactly what a holder holds: its list, and its memo
            job.scratch["held"], job.scratch["memo"] = True, found[1]
            return found[0]
        held = HELD.get_all(job.welcome.ipc)
        job.scratch["held"] = held is not None
        if held is not None:
            return held
        return [open_cuda(raw, job.device) if t is None else t
                for raw, t in zip(job.welcome.ipc, HELD.get_many(job.welcome.ipc))]


def describe_cuda(sources, cache: dict) -> dict:
    """{"ipc": a handle per storage, "locations": (storage index, byte offset) per tensor} of CUDA
    tensors that stay in place; made once per set of addresses (the cache keeps the storages alive)."""
    key = ("ipc-regions", tuple(t.data_ptr() for t in sources))
    if key in cache:
        return cache[key]
    storages: dict[int, int] = {}  # storage pointer -> region index
    handles, locations = [], []
    for t in sources:
        if t.numel() == 0:
            locations.append((0, 0))
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in storages:
            storages[ptr] = len(handles)
            handles.append(share_cuda(t, cache))
        locations.append((storages[ptr], t.data_ptr() - ptr))
    cache[key] = {"ipc": handles, "locations": locations}
    return cache[key]


def contiguous(specs, locations) -> tuple[int, int, int] | None:
    """(region, start, bytes) when the tensors lie back to back in one region, in manifest order."""
    items = [(loc, s.nbytes) for s, loc in zip(specs, locations) if s.nbytes]
    if not items:
        return None
    (region, start), _ = items[0]
    end = start
    for (r, offset), nbytes in items:
        if r != region or offset != end:
            return None
        end += nbytes
    return region, start, end - start
