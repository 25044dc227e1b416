"""Member side of the coordinator's registry: register, heartbeat, register again after a
coordinator restart, deregister on shutdown (or, with a reason, while it cannot serve: `leave`).
Services with --coordinator run one."""

from __future__ import annotations

import asyncio
import logging
import time

from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.coordinator.v1.coordinator_pb2_grpc import CoordinatorServiceStub
from rlsync.rpc.channel import aio_channel

log = logging.getLogger(__name__)


class Registrar:
    def __init__(self, coordinator: str, role: int, address: str, name: str = "", token: str = ""):
        self.coordinator, self.role, self.address, self.name = coordinator, role, address, name
        self.channel = aio_channel(coordinator, token)
        self.stub = CoordinatorServiceStub(self.channel)
        self.member_id = ""
        self.lease = 0.0  # the coordinator's, once registered
        self._task: asyncio.Task | None = None
        self._heard = time.monotonic()  # the coordinator's last answer

    def silent_for(self) -> float:
        """Seconds since the coordinator last answered (a registration or a heartbeat)."""
        return time.monotonic() - self._heard

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _register(self) -> float:
        r = await self.stub.Register(pb.RegisterRequest(role=self.role, address=self.address, name=self.name),
                                     timeout=10)
        self.member_id, self.lease = r.member_id, r.lease
        self._heard = time.monotonic()
        log.info("registered with the coordinator at %s as %s", self.coordinator, r.member_id)
        return r.heartbeat_interval

    async def _run(self) -> None:
        interval, warned = 1.0, False
        while True:
            try:
                if not self.member_id:
                    interval = await self._register()
                    warned = False
                beat = await self.stub.Heartbeat(pb.HeartbeatRequest(member_id=self.member_id), timeout=10)
                self._heard = time.monotonic()
                if not beat.known:
                    self.member_id = ""
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the coordinator may be down or not up yet: keep trying
                if not warned:
                    log.warning("coordinator at %s unreachable (%s); retrying", self.coordinator, e)
                    warned = True
                self.member_id = ""
            await asyncio.sleep(interval)

    async def leave(self, reason: str = "") -> None:
        """Leaves the fleet until `start()` again. With a reason (this member cannot serve what it is
        asked), the coordinator abandons every call to it at once and says why; without, the calls in
        flight end on their own. Safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        member_id, self.member_id = self.member_id, ""
        if member_id:
            try:
                await self.stub.Deregister(pb.DeregisterRequest(member_id=member_id, reason=reason), timeout=3)
            except Exception:  # noqa: BLE001 - leaving anyway; the lease expires it
                pass

    async def stop(self) -> None:
        """Leaves the fleet for good; safe to call twice."""
        await self.leave()
        await self.channel.close()
