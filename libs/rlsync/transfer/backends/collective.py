"""Broadcast channels: `gloo` (CPU, any host) and `nccl` (GPUs, any host), one sender to N ranks.

Process groups are built from a TCPStore the sender hosts, never touching a default group the
user's process may have. A group outlives one transfer: when the same receiver ranks come back
(they say which groups they still hold), it is reused, so NCCL's communicator setup is paid once.

Buckets go two at a time. A bucket whose bytes are contiguous in the sender's memory (flat
storage) is broadcast straight from there; one whose destination is contiguous lands straight in
place; anything else goes through one of two staging slots.
"""

from __future__ import annotations

import abc
import datetime
import os
import select
import socket
import threading
import uuid
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from rlsync.errors import DataLoss, DeadlineExceeded, Unavailable
from rlsync.transfer import delta
from rlsync.transfer.backends.base import ReceiveJob, SendJob, collect_results, expect, report_failure, sync
from rlsync.transfer.backends.groups import (GO_BYTES, Posted, _drop, _Session, check_go, drop_posted, go_tensor,
                                             keep_held, take_ahead, take_held, take_posted)
from rlsync.transfer.checksum import Checksums, as_bytes, checksum_bytes
from rlsync.transfer.control import Deadline
from rlsync.transfer.messages import Done, Mismatch, Refill, Result, Welcome
from rlsync.transfer.spans import copy_all, span
from rlsync.transfer.streams import resolved
from rlsync.transfer.v1 import transfer_pb2 as pb

SLOTS = 2  # buckets in flight


class _Broadcast(abc.ABC):
    local = False
    backend: int
    slot_device: str  # where staging slots live: "cpu" (gloo) or "cuda" (nccl)

    @abc.abstractmethod
    def _group(self, store: dist.Store, rank: int, world: int, deadline: Deadline, gid: str):
        """A process group of this backend over `store`, private to rlsync."""

    def _slots(self, session: _Session, job: SendJob | ReceiveJob) -> list[torch.Tensor]:
        """The group's staging slots, each as large as the plan's first (largest) bucket: made on first need
        (a transfer whose buckets all go straight from and to place needs none) and kept with it."""
        device = self._device(job)
        nbytes = job.plan[0].nbytes if job.plan else 1  # every bucket but the last is full (plan_buckets)
        held = session.slots
        if held is None or held[0].numel() < nbytes or held[0].device != device:
            session.slots = held = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        return [s[:nbytes] for s in held]

    # -- sender ---------------------------------------------------------------------------------
    def _session(self, job: SendJob) -> tuple[_Session, bool]:
        """The group for this transfer's receivers: the one its broadcasts were posted on ahead
        (rlsync.transfer.backends.groups), the one kept from their last transfer when every receiver
        still holds it (or posted its receives on it, for this plan), else a new one."""
        members = tuple(sorted((h.receiver_id, h.rank) for _, h in job.conns))
        key = ("group", self.backend, members)
        job.scratch["key"] = key
        plan = _plan_key(job)
        hellos = [h for _, h in job.conns]
        ahead = take_ahead(job.cache, job.transfer_id, key, plan, hellos)
        if ahead is not None:
            job.scratch["ahead"] = ahead
            return ahead.session, True
        # Out of the cache while a transfer uses it: one abandoned mid-way (a hung peer: its collectives
        # cannot be interrupted) runs on until its timeout, and must never share its group with the next.
        session = job.cache.pop(key, None)
        posted_ok = session is not None and session.plan == plan and job.delta_base is None  # (as posted: whole)
        if session is not None and all(session.gid in h.groups or (posted_ok and session.gid in h.posted)
                                       for h in hellos):
            return session, True
        _drop(session)
        timeout = datetime.timedelta(seconds=job.deadline.remaining("creating the process group"))
        store = dist.TCPStore(job.store_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        return _Session(uuid.uuid4().hex, store, None), False

    def send(self, job: SendJob) -> None:
        session, reuse = self._session(job)
        members = sorted(job.conns, key=lambda c: (c[1].receiver_id, c[1].rank))
        world = 1 + len(members)
        try:  # (a group with broadcasts posted ahead must not outlive a receiver gone before its Welcome)
            for rank, (conn, _) in enumerate(members, start=1):
                conn.send(Welcome(backend=self.backend, bucket_bytes=job.bucket_bytes, rank=rank, world=world,
                                  store=f"{job.store_host}:{session.store.port}", group=session.gid, reuse=reuse,
                                  verify=job.verify or job.delta_base is not None, delta=job.delta_base is not None))
            if not reuse:
                session.group = _bounded(lambda: self._group(session.store, 0, world, job.deadline, session.gid),
                                         [c for c, _ in job.conns], job.deadline, "forming the process group")
        except BaseException:
            job.scratch.pop("ahead", None)
            _drop(session)
            raise
        watchdog = _Watchdog(session.group, job.deadline, [c for c, _ in job.conns])
        checksums = Checksums()  # on the device, read once at the end: no stall between buckets
        job.wire_bytes = 0
        inflight: deque = deque()
        try:
            ahead = job.scratch.get("ahead")
            if ahead is not None:  # every broadcast is posted: wait for them
                posted = ahead.works
                job.wire_bytes = sum(b.nbytes for b in job.plan)
            else:
                posted = [session.group.broadcast(go_tensor(job.transfer_id, self._device(job)), 0)]  # its token
                if job.delta_base is not None:
                    self._send_deltas(job, session, self._slots(session, job), checksums)
                else:
                    for bucket in job.plan:
                        if len(inflight) == SLOTS:
                            inflight.popleft().wait()
                        view = self._outgoing(job, bucket,
                                              lambda i=bucket.index: self._slots(session, job)[i % SLOTS])
                        if job.verify:
                            checksums.add(view)
                        inflight.append(session.group.broadcast(view, 0))
                        job.wire_bytes += bucket.nbytes
                    while inflight:
                        inflight.popleft().wait()
            for work in posted:
                work.wait()
            if job.delta_base is None:  # (deltas synchronize bucket by bucket)
                sync(job.device)
            done = Done(checksums=checksums.values())
            for conn, _ in job.conns:
                conn.send(done)
            if job.delta_base is not None:
                self._refill(job, session, self._slots(session, job)[0])
        except BaseException as e:
            inflight.clear()  # pending work holds the group too
            job.scratch.pop("ahead", None)
            _drop(session)
            if isinstance(e, RuntimeError):  # the group failed: say which peer problem caused it
                raise watchdog.error(e) from e
            raise
        finally:
            watchdog.stop()
        try:
            collect_results(job)
        except BaseException:
            _drop(session)
            raise
        session.plan = None if job.delta_base is not None else _plan_key(job)  # what receivers may post next
        if job.cache.setdefault(job.scratch["key"], session) is not session:  # a newer transfer's is there
            _drop(session)

    def _device(self, job: SendJob | ReceiveJob) -> torch.device:
        return resolved(job.device) if self.slot_device == "cuda" else torch.device("cpu")

    def _outgoing(self, job: SendJob, bucket, slot: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A bucket's bytes where a broadcast can read them: the sender's storage when contiguous
        there, else packed into `slot()`. Each slice is read once, in order: a streamed source
        produces its tensors only forward."""
        parts = [job.sources[s.tensor][s.src:s.src + s.length] for s in bucket.slices]
        view = span(parts)
        if view is None or view.device.type != self.slot_device:
            view = slot()[:bucket.nbytes]
            copy_all((part, view[s.dst:s.dst + s.length]) for s, part in zip(bucket.slices, parts))
        return view

    def _send_deltas(self, job: SendJob, session: _Session, slots, checksums: Checksums) -> None:
        """Delta mode, one bucket at a time: a header (the payload's bytes, or -1: the bucket whole),
        then the payload. Each bucket's checksum is of its new bytes, whatever went on the wire."""
        header = torch.empty(1, dtype=torch.int64, device=slots[0].device)
        offset = 0
        for bucket in job.plan:
            new = self._outgoing(job, bucket, lambda: slots[0])
            base = job.delta_base[offset:offset + bucket.nbytes]
            offset += bucket.nbytes
            payload = delta.encode(new, base.to(new.device))  # blocking: a device-to-host copy is read at once
            checksums.add(new)
            header.fill_(-1 if payload is None else payload.numel())
            session.group.broadcast(header, 0).wait()
            payload = new if payload is None else payload.to(slots[0].device)
            session.group.broadcast(payload, 0).wait()
            job.wire_bytes += payload.numel()
            sync(slots[0].device)  # the slot is packed again for the next bucket

    def _refill(self, job: SendJob, session: _Session, slot: torch.Tensor) -> None:
        """Delta mode, after Done: the buckets any receiver rebuilt wrong (its base was not the
        version it said) go again, whole, to the group."""
        wrong: set[int] = set()
        for conn, hello in job.conns:
            msg, _ = expect(conn, Mismatch, job.deadline, f"waiting for {hello.receiver_id}'s checksum check")
            wrong.update(msg.buckets)
        refill = Refill(buckets=sorted(wrong))
        for conn, _ in job.conns:
            conn.send(refill)
        for index in refill.buckets:
            if not 0 <= index < len(job.plan):
                raise DataLoss(f"a receiver asked for bucket {index} of {len(job.plan)} again")
            bucket = job.plan[index]
            view = self._outgoing(job, bucket, lambda: slot)  # resident (delta mode): read again at will
            session.group.broadcast(view, 0).wait()
            job.wire_bytes += bucket.nbytes
            sync(slot.device)

    # -- receiver -------------------------------------------------------------------------------
    def receive(self, job: ReceiveJob) -> None:
        try:
            self._receive(job)
        except Exception as exc:
            _drop(job.scratch.pop("session", None))
            report_failure(job.conn, exc)
            raise

    def _confirm(self, job: ReceiveJob) -> None:
        """Checks that every byte is in, offers the group for reuse again (held_groups: before the
        sender hears of it, so the next transfer's Hello lists it), then tells the sender."""
        nbytes = job.writer.finish()
        job.clock.lap("verify")
        plan = None if job.welcome.delta else (tuple(s.nbytes for s in job.specs), job.welcome.bucket_bytes)
        keep_held(job.scratch.pop("session"), plan)
        job.conn.send(Result(ok=True, nbytes=nbytes, stages=job.clock.stages))

    def _join(self, job: ReceiveJob) -> _Session:
        w = job.welcome
        drop_posted(keep=w.group)  # a sender that names another group does not use those again
        if w.reuse:  # out of the held ones while in use (see _session)
            posted = take_posted(w.group, tuple(s.nbytes for s in job.specs), w.bucket_bytes, w.delta)
            if posted is not None:
                job.scratch["posted"] = posted
                job.scratch["session"] = posted.session
            else:
                job.scratch["session"] = take_held(w.group)
            return job.scratch["session"]
        host, _, port = w.store.rpartition(":")

        def join():
            timeout = datetime.timedelta(seconds=job.deadline.remaining("joining the process group"))
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            return store, self._group(store, w.rank, w.world, job.deadline, w.group)

        store, group = _bounded(join, [job.conn], job.deadline, "joining the process group")
        job.scratch["session"] = _Session(w.group, store, group)
        return job.scratch["session"]

    def _receive(self, job: ReceiveJob) -> None:
        session = self._join(job)
        job.clock.lap("join")
        watchdog = _Watchdog(session.group, job.deadline, [job.conn])
        checksums = Checksums()
        # Without checksums the sender's Done brings nothing to check: the receiver confirms as soon as
        # its broadcasts are done, and reads the Done after (it is on its way: the sender sends it first).
        early = not (job.welcome.verify or job.welcome.delta)
        try:
            posted = job.scratch.get("posted")
            if posted is not None:  # posted as it prepared (rlsync.transfer.backends.groups): the bytes may be in
                go = posted.go
                self._adopt(job, posted, checksums)
            else:
                go = torch.empty(GO_BYTES, dtype=torch.uint8, device=self._device(job))
                go_work = session.group.broadcast(go, 0)
                if job.welcome.delta:
                    self._receive_deltas(job, session, self._slots(session, job), checksums)
                else:
                    self._receive_whole(job, session, checksums)
                go_work.wait()
            check_go(go, job.transfer_id)
            # (posted: from the Welcome to the last byte, which may have come before it; no measure of the wire)
            job.clock.lap("broadcast" if posted is None else "posted_broadcast")
            if early:
                watchdog.stand_down()  # no collective is left: the sender hanging up after the Result aborts nothing
                self._confirm(job)
            done, _ = expect(job.conn, Done, job.deadline, "waiting for the end of the transfer")
            wrong = [i for i, (sent, got) in enumerate(zip(done.checksums, checksums.values())) if sent != got]
            if job.welcome.delta:
                self._refilled(job, session, self._slots(session, job)[0], wrong, done.checksums)
            elif wrong:
                raise DataLoss(f"bucket {wrong[0]} arrived corrupted (checksum mismatch): the destination must not "
                               "be used")
        except BaseException as e:
            if isinstance(e, RuntimeError):
                raise watchdog.error(e) from e
            raise
        finally:
            watchdog.stop()
        if not early:
            self._confirm(job)

    @staticmethod
    def _adopt(job: ReceiveJob, posted: Posted, checksums: Checksums) -> None:
        """Receives posted ahead (into this transfer's destination, as its Receiver laid it out): waits
        for them (the watchdog aborts them as it would any), then records every bucket landed."""
        for work in posted.works:
            work.wait()
        for bucket, view in zip(job.plan, posted.views):
            if job.welcome.verify:
                checksums.add(view)
            for s in bucket.slices:
                job.writer.mark(s.tensor, s.length)
        sync(job.device)

    def _receive_whole(self, job: ReceiveJob, session: _Session, checksums: Checksums) -> None:
        """Every bucket whole, two in flight, straight into the destination where it is contiguous."""
        inflight: deque = deque()  # (bucket, work, view, in place?)

        def post(bucket) -> None:
            view = job.writer.direct_span(bucket.slices)
            in_place = view is not None and view.device.type == self.slot_device
            if not in_place:
                view = self._slots(session, job)[bucket.index % SLOTS][:bucket.nbytes]
            inflight.append((bucket, session.group.broadcast(view, 0), view, in_place))

        try:
            pending = deque(job.plan)
            while pending and len(inflight) < SLOTS:
                post(pending.popleft())
            while inflight:
                bucket, work, view, in_place = inflight.popleft()
                work.wait()
                if job.welcome.verify:
                    checksums.add(view)  # queued before the slot's next broadcast, which waits for it
                if in_place:
                    for s in bucket.slices:
                        job.writer.mark(s.tensor, s.length)
                else:
                    job.writer.write_many([(s.tensor, s.src, view[s.dst:s.dst + s.length]) for s in bucket.slices])
                if not in_place and view.device.type == "cpu":
                    sync(job.device)  # the slot is reused by the next broadcast
                if pending:
                    post(pending.popleft())
            sync(job.device)
        except BaseException:
            inflight.clear()  # pending work holds the group, which receive() drops (see _drop)
            work = None  # noqa: F841 - the one being waited on too (the traceback keeps this frame)
            raise

    def _receive_deltas(self, job: ReceiveJob, session: _Session, slots, checksums: Checksums) -> None:
        """Delta mode: per bucket a header, then the bucket whole or its delta, which is applied to
        this receiver's base bytes of the bucket; either way the rebuilt bucket is checksummed."""
        if job.base is None:
            raise DataLoss("the sender sent deltas to a receiver that holds no base: the destination must not be used")
        base = [as_bytes(job.base[spec.name]) if spec.nbytes else None for spec in job.specs]
        header = torch.empty(1, dtype=torch.int64, device=slots[0].device)
        for bucket in job.plan:
            session.group.broadcast(header, 0).wait()
            size = int(header.item())
            out = slots[0][:bucket.nbytes]
            if size < 0:
                session.group.broadcast(out, 0).wait()
            else:
                payload = slots[1][:size]
                session.group.broadcast(payload, 0).wait()
                for s in bucket.slices:
                    out[s.dst:s.dst + s.length].copy_(base[s.tensor][s.src:s.src + s.length])
                delta.apply(payload, out)
            checksums.add(out)
            job.writer.write_many([(s.tensor, s.src, out[s.dst:s.dst + s.length]) for s in bucket.slices])
            sync(job.device)  # the slot is reused by the next bucket

    def _refilled(self, job: ReceiveJob, session: _Session, slot: torch.Tensor, wrong: list[int],
                  sent: list[str]) -> None:
        """Delta mode: says which buckets failed their checksum, then receives the union of every
        receiver's failures whole and checks them again; a second failure is real corruption."""
        job.conn.send(Mismatch(buckets=wrong))
        refill, _ = expect(job.conn, Refill, job.deadline, "waiting for the buckets to be sent again")
        for index in refill.buckets:
            bucket = job.plan[index]
            out = slot[:bucket.nbytes]
            session.group.broadcast(out, 0).wait()
            if checksum_bytes(out) != sent[index]:
                raise DataLoss(f"bucket {index} arrived corrupted twice (checksum mismatch): the destination must "
                               "not be used")
            for s in bucket.slices:  # already counted as received: overwrite in place
                job.writer.direct_view(s.tensor, s.src, s.length).copy_(out[s.dst:s.dst + s.length])
            sync(job.device)
        if refill.buckets:
            job.clock.lap("refill")


def _plan_key(job: SendJob) -> tuple:
    """What a group's receivers may post for its next transfer: the tensors' sizes and the bucket size."""
    return tuple(s.nbytes for s in job.specs), job.bucket_bytes


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class GlooChannel(_Broadcast):
    backend = pb.BACKEND_GLOO
    slot_device = "cpu"

    def _group(self, store, rank, world, deadline, gid):
        # Gloo's default device listens on whatever this host's name resolves to (127.0.1.1 on many
        # machines); peers on other hosts could not reach it. Listen where the route to the store goes.
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=deadline.remaining("creating the gloo group"))
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address_toward(store.host))]
        return dist.ProcessGroupGloo(dist.PrefixStore(gid, store), rank, world, options)


class NcclChannel(_Broadcast):
    backend = pb.BACKEND_NCCL
    slot_device = "cuda"

    def _group(self, store, rank, world, deadline, gid):
        # A dead peer must fail the transfer (our watchdog aborts the group), not make NCCL's own
        # error handling tear the whole engine process down. A user's explicit setting wins.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=deadline.remaining("creating the NCCL group"))
        return dist.ProcessGroupNCCL(dist.PrefixStore(gid, store), rank, world, options)


def _gone(conns) -> str | None:
    """Which peer's control connection has closed, without waiting."""
    readable, _, _ = select.select([c.sock for c in conns], [], [], 0)
    for conn in conns:
        if conn.sock in readable:
            try:
                if conn.sock.recv(1, socket.MSG_PEEK) == b"":
                    return conn.peer
            except OSError:
                return conn.peer
    return None


def _bounded(fn, conns, deadline: Deadline, doing: str):
    """Runs a blocking collective setup (store connect, group rendezvous) so that a peer dying
    meanwhile fails it at once, not when the setup's own timeout runs out. The abandoned attempt
    ends by itself at that timeout."""
    result: dict = {}
    done = threading.Event()

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            result["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name="rlsync-collective-setup").start()
    while not done.wait(0.05):
        peer = _gone(conns)
        if peer:
            raise Unavailable(f"{peer} disconnected while {doing} (process died?)")
        deadline.remaining(doing)
    error = result.get("error")
    if isinstance(error, dist.DistError):  # the store or a peer went away (connection reset, refused...)
        raise Unavailable(f"{doing} failed, the peer is gone or unreachable: {type(error).__name__}: {error}") \
            from error
    if error is not None:
        raise error
    return result["value"]


class _Watchdog:
    """Aborts the group when the deadline passes or a peer's control connection drops, so a
    collective waiting on a dead or stalled peer fails instead of hanging."""

    def __init__(self, group, deadline: Deadline, conns):
        self._stop = threading.Event()
        self._standing_down = threading.Event()  # no abort any more; stop() still ends the thread
        self._wake_r, self._wake_w = socket.socketpair()  # stop() must not wait out a select()
        self._group, self._deadline = group, deadline
        # Its own non-blocking handles on the control sockets: a peek must never wait, and the main
        # thread may read what select saw (a socket with a timeout turns EAGAIN into a wait).
        self._socks = [socket.socket(fileno=os.dup(c.sock.fileno())) for c in conns]
        for sock in self._socks:
            sock.setblocking(False)  # the main thread's reads always run with a timeout: no change for it
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks = self._socks
        while not self._stop.is_set():
            try:
                left = self._deadline.remaining()
            except DeadlineExceeded as e:
                self.reason = str(e)
                break
            readable, _, _ = select.select([*socks, self._wake_r], [], [], min(1.0, left))
            if self._wake_r in readable:
                break
            for sock in readable:
                try:
                    if sock.recv(1, socket.MSG_PEEK) == b"":
                        self.reason = "a peer closed its control connection (process died?)"
                except BlockingIOError:
                    pass
                except OSError:
                    self.reason = "a peer's control connection failed"
            if self.reason:
                break
            if readable:
                self._stop.wait(0.05)  # data is pending for the main thread; do not spin
        if self.reason and not self._stop.is_set() and not self._standing_down.is_set():
            try:
                self._group.abort()
            except Exception:  # noqa: BLE001 - best effort; the main thread reports the failure
                pass

    def stand_down(self) -> None:
        """From now on a peer hanging up aborts nothing (what the group ran is done), at once: stop(),
        later, waits for the thread."""
        self._standing_down.set()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._wake_w.send(b"x")
            self._thread.join()
            for sock in [self._wake_r, self._wake_w, *self._socks]:
                sock.close()
        self._group = None  # see _drop

    def error(self, exc: BaseException) -> Exception:
        """The rlsync error for a failed collective: a deadline, or a peer that is gone."""
        self.stop()
        if self.reason and "deadline" in self.reason:
            return DeadlineExceeded(self.reason)
        return Unavailable(f"{self.reason or 'a peer failed during the broadcast'} ({exc})")
