"""A member's heartbeats, from a process of its own: `python -m rlsync.rpc.beacon`, started by the
member's Registrar (rlsync.rpc.registrar) as its child.

A heartbeat thread inside the member waits for its GIL. Measured on 2 cores under CI's three lanes: a
replica generating and a trainer training kept their GIL for 1.3-2.6 s at a time (0.5-0.7 CPU-s used,
thousands of preemptions, the event loop turning once or twice), so heartbeats were late by a lease and
busy members were dropped. The beacon needs nothing of the member's: it registers, heartbeats every
interval with the member's progress counter (a page of memory, rlsync.common.progress) and its CPU time
and state (read from /proc), registers again when the coordinator does not know it, and deregisters.

What the beacon does, by what the member does:
- computes, its event loop held up: beats; the member's CPU time grows, which is evidence of progress
  (rlsync.coordinator.liveness).
- is stuck (a deadlock) or waits on a dead peer: beats; neither counter nor CPU time moves, so it is
  dropped at the lease (`stalled`); the beacon registers it again once its counter moves.
- is stopped (SIGSTOP): sends nothing while it is; dropped at the lease (`silent`).
- leaves in order (`Registrar.leave`: one line on the beacon's stdin, the reason): deregisters with that
  reason and exits.
- dies (its end of the pipe closes, or the beacon is orphaned): deregisters at once, "its process
  exited", so the coordinator abandons its calls then, not a lease later.

What the beacon tells the member (its member id, the coordinator's lease, when the coordinator last
answered) lies in a second page of shared memory (`Shared`)."""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import signal
import struct
import sys
import threading
import time

import grpc

from rlsync.common.progress import Watched
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.coordinator.v1.coordinator_pb2_grpc import CoordinatorServiceStub
from rlsync.rpc.channel import sync_channel

log = logging.getLogger("rlsync.rpc.beacon")
TOKEN_ENV = "RLSYNC_BEACON_TOKEN"  # the token travels in the environment, not on the command line


class Shared:
    """What the beacon writes and its member reads: member id, lease, when the coordinator last answered
    (CLOCK_MONOTONIC, the same in both processes). A sequence number around each write (odd while
    writing) lets a reader retry instead of seeing half of one."""

    _LAYOUT = struct.Struct("<Idd32s")

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("rlsync-beacon")
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self._page = mmap.mmap(fd, mmap.PAGESIZE)

    def write(self, member_id: str, lease: float, heard: float) -> None:
        seq = self._LAYOUT.unpack_from(self._page)[0]
        seq += seq & 1  # (a writer killed in the middle of a write left it odd)
        struct.pack_into("<I", self._page, 0, seq + 1)
        self._LAYOUT.pack_into(self._page, 0, seq + 1, lease, heard, member_id.encode())
        struct.pack_into("<I", self._page, 0, seq + 2)

    def read(self) -> tuple[str, float, float]:
        """(member id, "" when not registered; the lease, 0 until known; when last heard, 0: never)."""
        for _ in range(1000):  # (a beacon killed in the middle of a write leaves it odd)
            seq, lease, heard, member_id = self._LAYOUT.unpack_from(self._page)
            if seq % 2 == 0 and struct.unpack_from("<I", self._page)[0] == seq:
                break
            time.sleep(0)
        return member_id.rstrip(b"\0").decode(errors="replace"), lease, heard


class Beacon:
    def __init__(self, coordinator: str, token: str, role: int, address: str, name: str, member: int,
                 progress_fd: int, shared: Shared):
        self.coordinator, self.role, self.address, self.name = coordinator, role, address, name
        self.member, self.shared, self.watched = member, shared, Watched(member)
        self.channel = sync_channel(coordinator, token)  # (thread-safe: the leaving thread calls on it too)
        self.stub = CoordinatorServiceStub(self.channel)
        self.progress = memoryview(mmap.mmap(progress_fd, mmap.PAGESIZE)).cast("Q")
        self.member_id, self.lease, heard = shared.read()  # a beacon started again goes on as its member
        self.heard = heard
        self.lock = threading.Lock()  # the leaving thread against a registration in flight, and the page's writes
        self.stopped = threading.Event()
        self.quiet = threading.Event()  # no registration in flight
        self.quiet.set()
        self.forgotten: int | None = None  # the member's counter when the coordinator last forgot it

    def listen(self) -> None:
        """The member's stdin: one line, the reason it leaves ("": none); end of file: it died."""
        line = sys.stdin.readline()
        self.leave(line.rstrip("\n") if line else "its process exited (its heartbeat process saw it go)")

    def leave(self, reason: str) -> None:
        """Deregisters now, whatever call the heartbeat loop waits on (a registration in flight first
        lands, to be withdrawn too), and exits the process."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
        self.quiet.wait(15)
        if self.member_id:
            try:
                self.stub.Deregister(pb.DeregisterRequest(member_id=self.member_id, reason=reason), timeout=3)
            except grpc.RpcError:
                pass  # leaving anyway; the lease expires it
            self._forget()
        logging.shutdown()
        os._exit(0)

    def run(self) -> None:
        interval, warned = 1.0, False
        while not self.stopped.is_set():
            state, cpu = self.watched.sample()
            if not state or state in "ZX" or os.getppid() != self.member:
                self.leave("its process exited (its heartbeat process saw it go)")
                break  # (another thread is leaving)
            try:
                if not self.member_id and self.forgotten != self.progress[0]:  # (dropped stuck: not while it is)
                    interval = self._register() or interval
                    warned = False
                if self.member_id and state not in "Tt" and not self._beat(cpu):
                    continue  # the coordinator does not know it (restarted, or dropped it): register again
            except grpc.RpcError as e:  # the coordinator may be down or not up yet: keep trying
                # (as the member it was: a call that failed on a loaded host would otherwise register it anew, which
                # replaces its entry; a coordinator that no longer knows it says so at the next heartbeat)
                if not warned:
                    log.warning("coordinator at %s unreachable (%s); retrying", self.coordinator, e.code().name)
                    warned = True
            self.stopped.wait(interval)
        while True:  # the leaving thread ends the process (os._exit) once the coordinator has heard it
            time.sleep(3600)

    def _register(self) -> float:
        """Registers; returns the coordinator's heartbeat interval (0: it is leaving)."""
        with self.lock:
            if self.stopped.is_set():
                return 0.0
            self.quiet.clear()
        try:
            r = self.stub.Register(pb.RegisterRequest(role=self.role, address=self.address, name=self.name),
                                   timeout=10)
            self.member_id, self.lease = r.member_id, r.lease
            self._heard()
        finally:
            self.quiet.set()
        log.info("registered with the coordinator at %s as %s", self.coordinator, r.member_id)
        return r.heartbeat_interval

    def _beat(self, cpu: float) -> bool:
        """One heartbeat; False when the coordinator does not know this member."""
        beat = self.stub.Heartbeat(pb.HeartbeatRequest(member_id=self.member_id, progress=self.progress[0],
                                                       cpu_seconds=cpu), timeout=10)
        self._heard()
        if not beat.known:
            self._forget()
        return beat.known

    def _heard(self) -> None:
        with self.lock:  # (the page has one writer at a time; once leaving, only the leaving thread)
            if not self.stopped.is_set():
                self.heard = time.monotonic()
                self.shared.write(self.member_id, self.lease, self.heard)

    def _forget(self) -> None:
        with self.lock:
            self.member_id, self.forgotten = "", self.progress[0]
            self.shared.write("", self.lease, self.heard)


def main(argv: list[str] | None = None) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (a group's signal: its member says when to go)
        signal.signal(sig, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="python -m rlsync.rpc.beacon", description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--role", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--name", default="")
    p.add_argument("--member", type=int, required=True, help="the member's pid (this process's parent)")
    p.add_argument("--progress-fd", type=int, required=True)
    p.add_argument("--shared-fd", type=int, required=True)
    a = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    beacon = Beacon(a.coordinator, os.environ.pop(TOKEN_ENV, ""), a.role, a.address, a.name, a.member,
                    a.progress_fd, Shared(a.shared_fd))
    threading.Thread(target=beacon.listen, name="rlsync-beacon-stdin", daemon=True).start()
    beacon.run()


if __name__ == "__main__":
    main()
