"""Wires the rollout core to gRPC and to the shared serving lifecycle."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlsync.config import describe
from rlsync.coordinator.v1.coordinator_pb2 import ROLE_ROLLOUT
from rlsync.address import advertised
from rlsync.rpc.doorbell import DoorbellServer
from rlsync.rpc.registrar import Registrar
from rlsync.models import resolve_model
from rlsync.rollout.config import RolloutConfig
from rlsync.rollout.core import RolloutCore
from rlsync.rollout.engines import create_engine
from rlsync.rollout.engines.fp8_support import refuse_fp8_on_cpu
from rlsync.rollout.servicer import RolloutServicer
from rlsync.rollout.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


def _on_cpu() -> bool:
    """Whether this host has no GPU, asked without initializing CUDA here (NVML): vLLM forks its engine
    process from this one, and CUDA does not survive a fork."""
    import os

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return not torch.cuda.is_available()


class RolloutService:
    name = "rollout"
    service_names = [rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name]

    def __init__(self, cfg: RolloutConfig):
        self.cfg = cfg
        model = resolve_model(cfg.model)
        refuse_fp8_on_cpu(cfg.engine, model, on_cpu=_on_cpu)
        self.engine = create_engine(cfg.engine, model, cfg.engine_args)
        self.core = RolloutCore(self.engine, cfg.replica_id, cfg.update_timeout)

    async def start(self) -> None:
        log.info("starting %s engine: %s", self.cfg.engine, describe(self.cfg))
        await self.engine.start()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        self.servicer = RolloutServicer(self.core)
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.servicer, server)

    async def serving(self, host: str, port: int) -> None:
        self.registrar = None
        # A trainer on this host rings here with its offer (a prepare without a gRPC round trip), and
        # to have its weights held mapped from its onload to its offload.
        self.doorbell = DoorbellServer(self.servicer.doorbell_handlers(), self.cfg.server.token,
                                       self.core.replica_id)
        self.core.doorbell = await self.doorbell.start()
        if self.cfg.coordinator:
            address = advertised(host, port, self.cfg.server.advertise)
            self.registrar = Registrar(self.cfg.coordinator, ROLE_ROLLOUT, address, self.core.replica_id,
                                       self.cfg.server.token)
            self.registrar.start()
            if self.cfg.coordinator_lease > 0:
                self._lease = asyncio.create_task(self._hold_lease(self.cfg.coordinator_lease))

    async def _hold_lease(self, lease: float) -> None:
        """A replica the coordinator left paused, asleep or mid-update does not stay so forever: once
        the coordinator has been silent for `lease` seconds, the replica takes itself back."""
        while True:
            await asyncio.sleep(min(lease / 4, 1.0))
            silent = self.registrar.silent_for()
            held = self.core.paused or self.core.asleep or self.core.pending is not None
            if held and silent > lease:
                try:
                    await self.core.release_control(f"coordinator at {self.cfg.coordinator} silent for {silent:.0f}s",
                                                    still=lambda: self.registrar.silent_for() > lease)
                except Exception:  # noqa: BLE001 - tried again at the next tick
                    log.exception("could not take the replica back from its silent coordinator")

    async def failure(self) -> str:
        """Returns once the engine is dead, after taking this replica out of the coordinator's rotation."""
        while not (reason := self.engine.dead()):
            await asyncio.sleep(0.5)
        if self.registrar is not None:
            await self.registrar.stop()
        return reason

    async def drain(self, reason: str) -> None:
        if getattr(self, "_lease", None) is not None:
            self._lease.cancel()
        if getattr(self, "registrar", None) is not None:
            await self.registrar.stop()  # out of rotation first: no new requests arrive
        await self.core.drain(reason, finish_within=self.cfg.server.grace_seconds)

    async def close(self) -> None:
        if getattr(self, "doorbell", None) is not None:
            await self.doorbell.close()
        await self.engine.shutdown()
