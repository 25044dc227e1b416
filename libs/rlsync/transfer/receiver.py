"""The receiving end: answers an offer (choosing the channel), then receives into destinations."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping

import torch

from rlsync.common.timing import Stopwatch
from rlsync.common.trace import traced
from rlsync.errors import Aborted, DataLoss, InvalidArgument
from rlsync.flat import FlatStore
from rlsync.transfer.armed import Armed, Bell, key_of
from rlsync.transfer.backends import available, channel
from rlsync.transfer import routed_groups
from rlsync.transfer.backends.groups import drop_posted, held_groups, post_held
from rlsync.transfer.backends.base import ReceiveJob
from rlsync.transfer.control import Deadline, connect
from rlsync.transfer.handshake import NAMES, PROTOCOL_VERSION, backend_of, local_facts, make_answer
from rlsync.transfer.manifest import check_against, from_proto
from rlsync.transfer.messages import Hello, Reject, Welcome, error_from
from rlsync.transfer.plan import cached_plan
from rlsync.transfer.sender import Report
from rlsync.transfer.sharded import RoutedReceiver, whole_layout
from rlsync.transfer.streams import handed_over, on_transfer_stream, resolved
from rlsync.transfer.v1 import transfer_pb2 as pb
from rlsync.transfer.writer import Destination, DestWriter


def answer(offer: pb.Offer, receiver_id: str, *, device: torch.device | str = "cpu", ranks: int = 1,
           force: str | None = None, bucket_bytes: int = 0, base_version: int | None = None,
           layout: list[pb.RankLayout] | None = None, unusable: frozenset[int] = frozenset()) -> pb.Answer:
    """Chooses the channel for a receiver whose destination tensors live on `device`.
    base_version: the version of the weights this receiver will hand Receiver as `base` (laid out
    as the manifest: same names, dtypes and shapes; a FlatStore laid out as the manifest is taken
    without looking at any tensor), so a broadcast may send it deltas.
    layout: for a routed offer (a sharded sender), the boxes each of the `ranks` loads; left out,
    every rank loads every tensor whole.
    unusable: backends this receiver found it cannot use with this sender (a mapping refused: Unmappable)."""
    routed = offer.HasField("routing")
    facts = local_facts(device)
    ans = make_answer(offer, receiver_id, facts, ranks, available() - unusable,
                      backend_of(force) if force else None, bucket_bytes, None if routed else base_version)
    if routed:
        specs = from_proto(offer.manifest)
        ans.layout.extend(layout if layout is not None else [whole_layout(specs)] * ranks)
        if len(ans.layout) != ranks:
            raise InvalidArgument(f"a layout of {len(ans.layout)} ranks for a receiver of {ranks}")
        for rank in ans.layout:  # a rank that did not say where it runs runs here
            if not rank.HasField("facts"):
                rank.facts.CopyFrom(facts)
        ans.groups.extend(routed_groups.held())  # the sender may reuse one (this process's, for all its ranks)
    return ans


def receiver_for(offer: pb.Offer, answer: pb.Answer, dest: Destination, **kwargs) -> Receiver | RoutedReceiver:
    """The receiving end this offer needs: a routed one for a sharded sender (its `boxes` say which
    box of each tensor `dest` holds), else a Receiver (its `expected` and `base` apply)."""
    if offer.HasField("routing"):
        kwargs.pop("expected", None), kwargs.pop("base", None), kwargs.pop("post", None)
        return RoutedReceiver(offer, answer, dest, **kwargs)
    kwargs.pop("boxes", None), kwargs.pop("at_once", None)
    return Receiver(offer, answer, dest, **kwargs)


class Receiver:
    """One receiving end, prepared ahead: parsing the manifest, laying out the destination and
    connecting happen here, so the sender's clock starts with everything ready; run() moves the bytes.

    On any failure run() raises, and `dest` must not be used: receive into staging memory and
    switch only after run() returns (rlsync's engines do).

    A pull (answer.pull: cuda_ipc over memory the offer describes) needs no sender: run() maps and
    copies, and must return before the answer is handed back, since the sender does not wait for
    receivers that pulled. When the sender waits on the GPU instead (offer.mapped.waits) and the
    memory stays mapped, run() returns once the copy is queued; the report's `copied` is the CUDA
    event to put in the answer (rlsync.transfer.copied).

    The bytes move on a stream of their own, beside an engine generating on its default stream
    (rlsync.transfer.streams): after dest as the caller's stream held it at construction, and before
    what the caller's stream queues after run().

    hold: a cuda_ipc one-copy keeps the sender's storages mapped afterwards, under this holder name
    (rlsync.transfer.held): the next transfer from memory still in place maps and closes nothing,
    and a storage it no longer lists is closed then. The caller must `HELD.release(hold)` before the
    sender's memory may leave the GPU (memory another process maps is not freed).

    post: over NCCL, when the offer allows it, post the receives at once into `dest` on the group of
    the last transfer of the same plan (rlsync.transfer.backends.groups), so the bytes may come
    before the sender has this receiver's answer; False for a `dest` that is live (an engine
    receiving in place), which an abandoned transfer must never write."""

    def __init__(self, offer: pb.Offer, answer: pb.Answer, dest: Destination, *, rank: int = 0,
                 device: torch.device | str | None = None, timeout: float = 300.0,
                 expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]] | None = None,
                 base: Mapping[str, torch.Tensor] | FlatStore | None = None, hold: str = "", post: bool = True):
        clock = Stopwatch()
        self.hold = hold
        self.offer, self.answer = offer, answer
        self.specs = from_proto(offer.manifest)
        if expected is not None:
            check_against(self.specs, expected)
        self.base = None
        if answer.delta:  # the base holds the manifest's tensors as sent: same names, shapes and dtypes
            if base is None:
                raise InvalidArgument("the answer offers deltas (base_version) but the Receiver was given no base")
            flat = isinstance(base, FlatStore)
            self.base = base.views_for(self.specs) if flat else base
            if not (flat and base.laid_out_as(self.specs)):
                check_against(self.specs, {n: (tuple(t.shape), t.dtype) for n, t in self.base.items()})
        if device is None:
            views = dest.views if isinstance(dest, FlatStore) else dest
            first = next(iter(views.values()), None) if isinstance(views, Mapping) else None
            device = first.device if first is not None else torch.device(answer.facts.device_type or "cpu")
        self.device = resolved(torch.device(device))  # this thread's GPU: run() may run in another
        self.dest = dest
        self.writer = DestWriter(self.specs, dest, self.device)
        self._held_pull = 0  # bytes of the pull run() made from held storages: what arm() may queue again
        self.handed = handed_over(self.device)  # dest as the caller's stream leaves it (rlsync.transfer.streams)
        if answer.delta and not self.writer.in_place:
            raise InvalidArgument("delta updates land bytes as sent: every destination must be contiguous, in the "
                                  "manifest's dtype (answer without base_version to have them cast)")
        self.channel = channel(answer.backend)
        self.deadline = Deadline(timeout, f"receiving transfer {offer.transfer_id[:8]} "
                                          f"(version {offer.manifest.version})")
        self.start = time.perf_counter()
        clock.lap("layout")  # the manifest, the destination laid out, the caller's stream marked
        self.conn = None  # a pull needs no connection: the offer says where the bytes are
        self.posted: str | None = None  # the group it posted its receives on (transfer.backends.groups)
        self.adopted_posted = False  # ... and whether the transfer came there
        if not answer.pull:
            local = self.channel.local
            if post and offer.post_ahead and answer.backend == pb.BACKEND_NCCL:  # the bytes may move before it connects
                self.posted = post_held(tuple(s.nbytes for s in self.specs), answer.bucket_bytes or offer.bucket_bytes,
                                        self.writer)
                clock.lap("post")
            try:
                self.conn = connect(offer.local_control if local else offer.control_address, self.deadline, local)
                self.conn.send(Hello(PROTOCOL_VERSION, offer.transfer_id, offer.token, answer.receiver_id, rank,
                                     answer.ranks, answer.backend, held_groups() if not local else [],
                                     [self.posted] if self.posted else []))
            except BaseException:
                self._drop_posted()
                raise
            clock.lap("connect")
        self.setup = clock.stages  # seconds of each stage of the above

    def run(self) -> Report:
        with on_transfer_stream(self.device, self.handed), traced("receive"):
            return self._pull() if self.conn is None else self._receive()

    def _receive(self) -> Report:
        try:
            msg, fds = self.conn.recv(self.deadline, "waiting for the sender to start the transfer")
            if isinstance(msg, Reject):
                raise error_from(msg.code, f"sender refused this receiver: {msg.reason}")
            if not isinstance(msg, Welcome):
                raise Aborted(f"protocol error: expected Welcome, got {type(msg).__name__}")
            plan = list(cached_plan(tuple(s.nbytes for s in self.specs), msg.bucket_bytes))
            job = ReceiveJob(self.conn, msg, fds, self.specs, plan, self.writer, self.device, self.deadline,
                             self.offer.transfer_id, base=self.base, hold=self.hold)
            self.channel.receive(job)
            self.adopted_posted = "posted" in job.scratch
        finally:
            self.conn.close()
            self._drop_posted()
        return Report(sum(s.nbytes for s in self.specs), time.perf_counter() - self.start,
                      {NAMES[self.answer.backend]: 1})

    def _pull(self) -> Report:
        """Maps the memory the offer describes and copies every tensor from it (cuda_ipc)."""
        mapped = self.offer.mapped
        if not (len(mapped.region) == len(mapped.offset) == len(self.specs)) or (
                mapped.dtype and len(mapped.dtype) != len(self.specs)):
            raise DataLoss(f"the offer maps {len(mapped.region)} tensors ({len(mapped.dtype)} dtypes), its manifest "
                           f"has {len(self.specs)}")
        job = self._pull_job(self.writer)
        nbytes, copied = self.channel.pull(job, queued=mapped.waits)
        self._held_pull = nbytes if job.scratch.get("held") else 0
        return Report(nbytes, time.perf_counter() - self.start, {NAMES[self.answer.backend]: 1},
                      profile={"setup": sum(self.setup.values()), **job.clock.stages}, copied=copied)

    def _pull_job(self, writer: DestWriter, ipc: list[bytes] | None = None) -> ReceiveJob:
        mapped = self.offer.mapped
        welcome = Welcome(self.answer.backend, self.offer.bucket_bytes, one_copy=True,
                          ipc=list(mapped.ipc) if ipc is None else list(ipc),
                          locations=list(zip(mapped.region, mapped.offset)), dtypes=list(mapped.dtype))
        return ReceiveJob(None, welcome, [], self.specs, [], writer, self.device, self.deadline,
                          self.offer.transfer_id, hold=self.hold)

    def arm(self, bell: Bell, ipc: list[bytes] | None = None, cancellable: bool = False) -> Armed | None:
        """After run() pulled from storages held under `hold`: the same pull again, queued now behind
        `bell` (rlsync.transfer.armed), for the sender to start on the GPU when it offers the same
        tensors from the same places (`Armed.adopt`); from the storages `ipc` names where given (the
        same layout, held anew: a trainer's next onload), else from the ones it pulled from. None when
        there is nothing to repeat: no pull from held storages, a manifest with checksums (they change
        with every version, and must be checked), or a pull that was not one launch of a kept table
        (transfer.backends.slots: repeat). Arm only where this process queues nothing else on the GPU
        until the next offer, and disarm before anything that waits for the whole device. `cancellable`: only a
        copy that `Armed.withdraw` can empty (a table launch; not one whole copy)."""
        if not self._held_pull or any(s.checksum for s in self.specs):
            return None
        ipc = list(self.offer.mapped.ipc) if ipc is None else list(ipc)
        repeat = self.channel.repeat(self._pull_job(DestWriter(self.specs, self.dest, self.device), ipc))
        if repeat is None or (cancellable and repeat[1] is None):
            return None
        mapped = self.offer.mapped
        return Armed(bell, repeat[0], self._held_pull,
                     key_of(self.specs, ipc, mapped.region, mapped.offset, mapped.dtype), cancel=repeat[1])

    def _drop_posted(self) -> None:
        """Receives it posted that no Welcome took (they would wait on the GPU for a transfer that
        never comes)."""
        if self.posted is not None:
            drop_posted(only=self.posted)

    def close(self) -> None:
        """Ends the transfer from another thread too: run() then fails instead of waiting on."""
        if self.conn is None:
            return  # a pull runs in the thread that asked for it
        self._drop_posted()
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


def receive(offer: pb.Offer, answer: pb.Answer, dest: Destination, **kwargs) -> Report:
    """Receiver(offer, answer, dest, **kwargs).run(): every tensor of the offer into `dest` (a
    name->tensor mapping written in place, or a callable given each complete tensor)."""
    return Receiver(offer, answer, dest, **kwargs).run()
