"""Member side of the coordinator's registry: register, heartbeat, register again after a
coordinator restart, deregister on shutdown (or, with a reason, while it cannot serve: `leave`).
Services with --coordinator run one.

Heartbeats leave from a thread of their own, over a channel of their own, so a busy event loop
(hundreds of streams on a starved CPU) does not make them late. Each carries the process's progress
counter (rlsync.common.progress), which the event loop advances as it turns: a heartbeat whose
counter stood still says the process is scheduled but stuck, and the coordinator does not count it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from rlsync.common.progress import PROGRESS
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.coordinator.v1.coordinator_pb2_grpc import CoordinatorServiceStub
from rlsync.rpc.channel import aio_channel, sync_channel

log = logging.getLogger(__name__)
TICK = 0.1  # seconds between two turns of the event loop that count as its progress


class Registrar:
    def __init__(self, coordinator: str, role: int, address: str, name: str = "", token: str = ""):
        self.coordinator, self.role, self.address, self.name, self.token = coordinator, role, address, name, token
        self.channel = aio_channel(coordinator, token)  # the event loop's own calls (Deregister)
        self.stub = CoordinatorServiceStub(self.channel)
        self.member_id = ""
        self.lease = 0.0  # the coordinator's, once registered
        self.lock = threading.Lock()  # member_id between the heartbeat thread and the event loop
        self._beats: _Beats | None = None
        self._ticker: asyncio.Task | None = None
        self._heard = time.monotonic()  # the coordinator's last answer

    def silent_for(self) -> float:
        """Seconds since the coordinator last answered (a registration or a heartbeat)."""
        return time.monotonic() - self._heard

    def heard(self) -> None:
        self._heard = time.monotonic()

    def start(self) -> None:
        """Registers and heartbeats until `leave()`; call it on the event loop whose turns count as progress."""
        if self._beats is None:
            self._ticker = asyncio.create_task(_tick())
            self._beats = _Beats(self)
            self._beats.start()

    async def leave(self, reason: str = "") -> None:
        """Leaves the fleet until `start()` again. With a reason (this member cannot serve what it is
        asked), the coordinator abandons every call to it at once and says why; without, the calls in
        flight end on their own. Safe to call twice."""
        with self.lock:  # a registration that lands after this is withdrawn by its thread
            if self._beats is not None:
                self._beats.stopped.set()
            self._beats = None
            member_id, self.member_id = self.member_id, ""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if member_id:
            try:
                await self.stub.Deregister(pb.DeregisterRequest(member_id=member_id, reason=reason), timeout=3)
            except Exception:  # noqa: BLE001 - leaving anyway; the lease expires it
                pass

    async def stop(self) -> None:
        """Leaves the fleet for good; safe to call twice."""
        await self.leave()
        await self.channel.close()


async def _tick() -> None:
    while True:
        await asyncio.sleep(TICK)
        PROGRESS.advance()


class _Beats(threading.Thread):
    """Registers (again, whenever the coordinator does not know it) and heartbeats until stopped."""

    def __init__(self, registrar: Registrar):
        super().__init__(name="rlsync-heartbeat", daemon=True)
        self.r = registrar
        self.stopped = threading.Event()

    def run(self) -> None:
        channel = sync_channel(self.r.coordinator, self.r.token)
        stub = CoordinatorServiceStub(channel)
        interval, warned = 1.0, False
        try:
            while not self.stopped.is_set():
                try:
                    member_id = self.r.member_id
                    if not member_id:
                        member_id, interval = self._register(stub, interval)
                        warned = False
                    if member_id and not self._beat(stub, member_id):
                        continue  # the coordinator does not know it (restarted, or dropped it): register again now
                except grpc.RpcError as e:  # the coordinator may be down or not up yet: keep trying
                    if not warned:
                        log.warning("coordinator at %s unreachable (%s); retrying", self.r.coordinator,
                                    e.code().name)
                        warned = True
                    self._forget(self.r.member_id)
                self.stopped.wait(interval)
        finally:
            channel.close()

    def _register(self, stub: CoordinatorServiceStub, interval: float) -> tuple[str, float]:
        r = stub.Register(pb.RegisterRequest(role=self.r.role, address=self.r.address, name=self.r.name), timeout=10)
        with self.r.lock:
            late = self.stopped.is_set()  # it left meanwhile: withdrawn below
            if not late:
                self.r.member_id, self.r.lease = r.member_id, r.lease
        if late:
            try:
                stub.Deregister(pb.DeregisterRequest(member_id=r.member_id), timeout=3)
            except grpc.RpcError:
                pass  # its lease expires it
            return "", interval
        self.r.heard()
        log.info("registered with the coordinator at %s as %s", self.r.coordinator, r.member_id)
        return r.member_id, r.heartbeat_interval or interval

    def _beat(self, stub: CoordinatorServiceStub, member_id: str) -> bool:
        """One heartbeat; False when the coordinator does not know this member."""
        beat = stub.Heartbeat(pb.HeartbeatRequest(member_id=member_id, progress=PROGRESS.count), timeout=10)
        self.r.heard()
        if not beat.known:
            self._forget(member_id)
        return beat.known

    def _forget(self, member_id: str) -> None:
        with self.r.lock:
            if not self.stopped.is_set() and member_id and self.r.member_id == member_id:
                self.r.member_id = ""
