"""Broadcast channels: `gloo` (CPU, any host) and `nccl` (GPUs, any host), one sender to N ranks.

Each transfer builds a process group of its own from a TCPStore the sender hosts, so a default
group the user's process may have is never touched. Buckets are double-buffered: while bucket i
is broadcast, bucket i+1 is packed (sender) or bucket i-1 copied out (receivers). Checksums,
when asked for, are compared after the last bucket and before the receiver reports success.
"""

from __future__ import annotations

import abc
import datetime
import threading

import torch
import torch.distributed as dist

from rlsync.errors import DataLoss, DeadlineExceeded, Unavailable
from rlsync.transfer.backends.base import (ReceiveJob, SendJob, collect_results, expect, report_failure,
                                           sync)
from rlsync.transfer.checksum import checksum_bytes
from rlsync.transfer.control import Deadline
from rlsync.transfer.messages import Done, Result, Welcome
from rlsync.transfer.v1 import transfer_pb2 as pb

SLOTS = 2


class _Broadcast(abc.ABC):
    local = False
    backend: int
    slot_device: str  # where slots live: "cpu" (gloo) or "cuda" (nccl)

    @abc.abstractmethod
    def _group(self, store: dist.Store, rank: int, world: int, deadline: Deadline, transfer_id: str):
        """A process group of this backend over `store`, private to one transfer."""

    def _slots(self, device: torch.device, nbytes: int, cache: dict | None) -> list[torch.Tensor]:
        device = device if self.slot_device == "cuda" else torch.device("cpu")
        key = (self.slot_device, device, nbytes)
        if cache is not None and key in cache:
            return cache[key]
        slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
        if cache is not None:
            cache[key] = slots
        return slots

    # -- sender ---------------------------------------------------------------------------------
    def send(self, job: SendJob) -> None:
        timeout = datetime.timedelta(seconds=job.deadline.remaining("creating the process group"))
        store = dist.TCPStore(job.store_host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        world = 1 + len(job.conns)
        for rank, (conn, _) in enumerate(job.conns, start=1):
            conn.send(Welcome(backend=self.backend, bucket_bytes=job.bucket_bytes, rank=rank, world=world,
                              store=f"{job.store_host}:{store.port}", verify=job.verify))
        group = self._group(store, 0, world, job.deadline, job.transfer_id)
        watchdog = _Watchdog(group, job.deadline, [c for c, _ in job.conns])
        try:
            slot_bytes = max((b.nbytes for b in job.plan), default=1)
            slots = self._slots(job.device, slot_bytes, job.cache)
            works: list = [None] * SLOTS
            checksums = []
            for bucket in job.plan:
                slot = bucket.index % SLOTS
                if works[slot] is not None:
                    works[slot].wait()
                view = slots[slot][:bucket.nbytes]
                for s in bucket.slices:
                    view[s.dst:s.dst + s.length].copy_(job.sources[s.tensor][s.src:s.src + s.length],
                                                       non_blocking=True)
                if job.verify:
                    checksums.append(checksum_bytes(view))
                works[slot] = group.broadcast(view, 0)
            for work in works:
                if work is not None:
                    work.wait()
            sync(slots[0].device)
        except RuntimeError as e:  # the group failed: say which peer problem caused it
            raise watchdog.error(e) from e
        finally:
            watchdog.stop()
            _shutdown(group)
        for conn, _ in job.conns:
            conn.send(Done(checksums=checksums))
        collect_results(job)

    # -- receiver -------------------------------------------------------------------------------
    def receive(self, job: ReceiveJob) -> None:
        try:
            nbytes = self._receive(job)
        except Exception as exc:
            report_failure(job.conn, exc)
            raise
        job.conn.send(Result(ok=True, nbytes=nbytes))

    def _receive(self, job: ReceiveJob) -> int:
        w = job.welcome
        host, _, port = w.store.rpartition(":")
        timeout = datetime.timedelta(seconds=job.deadline.remaining("joining the process group"))
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        group = self._group(store, w.rank, w.world, job.deadline, job.transfer_id)
        watchdog = _Watchdog(group, job.deadline, [job.conn])
        checksums = []
        try:
            slot_bytes = max((b.nbytes for b in job.plan), default=1)
            slots = self._slots(job.device, slot_bytes, None)
            works: dict[int, object] = {}

            def post(i: int) -> None:
                if i < len(job.plan):
                    works[i] = group.broadcast(slots[i % SLOTS][:job.plan[i].nbytes], 0)

            for i in range(min(SLOTS, len(job.plan))):
                post(i)
            for bucket in job.plan:
                works.pop(bucket.index).wait()
                view = slots[bucket.index % SLOTS][:bucket.nbytes]
                if w.verify:
                    checksums.append(checksum_bytes(view))
                for s in bucket.slices:
                    job.writer.write(s.tensor, s.src, view[s.dst:s.dst + s.length])
                if view.device.type == "cpu":
                    sync(job.device)  # the slot is reused by the next broadcast
                post(bucket.index + SLOTS)
            sync(job.device)
        except RuntimeError as e:
            raise watchdog.error(e) from e
        finally:
            watchdog.stop()
            _shutdown(group)
        done, _ = expect(job.conn, Done, job.deadline, "waiting for the end of the transfer")
        for i, (sent, got) in enumerate(zip(done.checksums, checksums)):
            if sent != got:
                raise DataLoss(f"bucket {i} arrived corrupted (checksum mismatch): the destination must not be used")
        return job.writer.finish()


class GlooChannel(_Broadcast):
    backend = pb.BACKEND_GLOO
    slot_device = "cpu"

    def _group(self, store, rank, world, deadline, transfer_id):
        timeout = datetime.timedelta(seconds=deadline.remaining("creating the gloo group"))
        return dist.ProcessGroupGloo(dist.PrefixStore(transfer_id, store), rank, world, timeout)


class NcclChannel(_Broadcast):
    backend = pb.BACKEND_NCCL
    slot_device = "cuda"

    def _group(self, store, rank, world, deadline, transfer_id):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=deadline.remaining("creating the NCCL group"))
        return dist.ProcessGroupNCCL(dist.PrefixStore(transfer_id, store), rank, world, options)


class _Watchdog:
    """Aborts the group when the deadline passes or a peer's control connection drops, so a
    collective waiting on a dead or stalled peer fails instead of hanging."""

    def __init__(self, group, deadline: Deadline, conns):
        self._stop = threading.Event()
        self._group, self._deadline, self._conns = group, deadline, conns
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select

        socks = [c.sock for c in self._conns]
        while not self._stop.is_set():
            try:
                left = self._deadline.remaining()
            except DeadlineExceeded as e:
                self.reason = str(e)
                break
            readable, _, _ = select.select(socks, [], [], min(0.2, left))
            for sock in readable:
                try:
                    if sock.recv(1, 0x2) == b"":  # MSG_PEEK: EOF means the peer is gone
                        self.reason = "a peer closed its control connection (process died?)"
                except OSError:
                    self.reason = "a peer's control connection failed"
            if self.reason:
                break
            if readable:
                self._stop.wait(0.05)  # data is pending for the main thread; do not spin
        if self.reason and not self._stop.is_set():
            try:
                self._group.abort()
            except Exception:  # noqa: BLE001 - best effort; the main thread reports the failure
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def error(self, exc: BaseException) -> Exception:
        """The rlsync error for a failed collective: a deadline, or a peer that is gone."""
        self.stop()
        if self.reason and "deadline" in self.reason:
            return DeadlineExceeded(self.reason)
        return Unavailable(f"{self.reason or 'a peer failed during the broadcast'} ({exc})")


def _shutdown(group) -> None:
    try:
        group.shutdown()
    except Exception:  # noqa: BLE001
        pass
