"""The coordinator's logic: fleet membership, training through the sync sequences, status. No gRPC here."""

from __future__ import annotations

import asyncio
import logging

from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.gateway import Gateway
from rlsync.coordinator.registry import Registry
from rlsync.coordinator.sync import Syncer
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.errors import FailedPrecondition
from rlsync.trainer.v1 import trainer_pb2

log = logging.getLogger(__name__)
MODES = {"colocated": pb.SYNC_MODE_COLOCATED, "async": pb.SYNC_MODE_ASYNC, "inflight": pb.SYNC_MODE_INFLIGHT}
_STALE = {"keep": trainer_pb2.STALE_POLICY_KEEP, "drop": trainer_pb2.STALE_POLICY_DROP,
          "downweight": trainer_pb2.STALE_POLICY_DOWNWEIGHT}


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        self.registry = Registry(cfg.server.token, cfg.lease)
        self.syncer = Syncer(self.registry, cfg)
        self.gateway = Gateway(self.registry, self.syncer, cfg)
        self.registry.on_join = self.syncer.catch_up
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        if self.cfg.trainer:
            self.registry.add(pb.ROLE_TRAINER, self.cfg.trainer, "trainer", static=True)
            self.registry.spawn(self.syncer.trainer_joined())  # learns its step, as for one that registers
        for address in self.cfg.rollouts:
            self.registry.add(pb.ROLE_ROLLOUT, address, static=True)
        self._tasks.append(asyncio.create_task(self.registry.expire_forever()))

    def register(self, role: int, address: str, name: str) -> str:
        member = self.registry.add(role, address, name)
        if role == pb.ROLE_TRAINER:
            self.registry.spawn(self.syncer.trainer_joined())
        return member.id

    async def train(self, request: trainer_pb2.TrainRequest) -> trainer_pb2.TrainResponse:
        trainer = self.registry.trainer()
        if trainer is None:
            raise FailedPrecondition("no trainer is registered")
        phases = await self.syncer.before_train() if self.cfg.sync_mode == "colocated" else {}
        if not request.HasField("max_staleness") and self.cfg.max_staleness >= 0:
            request.max_staleness = self.cfg.max_staleness
        if not request.stale_policy:
            request.stale_policy = _STALE[self.cfg.stale_policy]
        response = await trainer.client._call("Train", request, timeout=3600)
        self.syncer.trainer_step = response.step
        for name, seconds in phases.items():  # colocated: what preceded the step (sleep, onload)
            response.metrics[f"{name}_seconds"] = seconds
        return response

    def status(self) -> pb.FleetStatus:
        import time

        now = time.monotonic()
        members = [pb.Member(id=m.id, name=m.name, role=m.role, address=m.address, state=m.state,
                             weight_version=m.weight_version, seconds_since_heartbeat=now - m.evidence.heartbeat_at,
                             in_flight=m.in_flight, backend=m.backend, suspect=m.suspect,
                             seconds_since_progress=now - m.evidence.progress_at)
                   for m in self.registry.members.values()]
        return pb.FleetStatus(
            mode=MODES[self.cfg.sync_mode],
            weight_version=self.syncer.version, trainer_step=self.syncer.trainer_step, members=members,
            max_staleness=self.cfg.max_staleness, gateway_in_flight=self.gateway.in_flight,
            resubmissions=self.gateway.resubmissions, syncs=self.syncer.syncs)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for m in list(self.registry.members.values()):
            await m.client.close()
