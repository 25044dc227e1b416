"""Wires the trainer core to gRPC and to the shared serving lifecycle."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlsync.config import describe
from rlsync.launch import exit_status
from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER
from rlsync.address import advertised
from rlsync.rpc.registrar import Registrar
from rlsync.trainer.config import TrainerConfig
from rlsync.trainer.core import TrainerCore
from rlsync.trainer.servicer import TrainerServicer
from rlsync.trainer.v1 import trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


class TrainerService:
    name = "trainer"
    service_names = [trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name]

    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.core: TrainerCore | None = None

    async def start(self) -> None:
        log.info("starting trainer: %s", describe(self.cfg))
        self.core = await asyncio.to_thread(TrainerCore, self.cfg)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        self.servicer = TrainerServicer(self.core, self.cfg.server.token)
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(self.servicer, server)

    async def serving(self, host: str, port: int) -> None:
        self.registrar = None
        if self.cfg.coordinator:
            address = advertised(host, port, self.cfg.server.advertise)
            self.registrar = Registrar(self.cfg.coordinator, ROLE_TRAINER, address, "trainer", self.cfg.server.token)
            self.registrar.start()

    async def failure(self) -> str:
        """Returns when a rank of a sharded trainer (--nproc > 1) has died: the others cannot go on."""
        while True:
            for i, proc in enumerate(self.core.rank_procs, 1):
                if proc.poll() is not None:
                    return f"trainer rank {i} {exit_status(proc.returncode)}: restart the trainer"
            await asyncio.sleep(0.5)

    async def drain(self, reason: str) -> None:
        if getattr(self, "registrar", None) is not None:
            await self.registrar.stop()
        async with self.core.lock:  # let a running step or publish finish
            pass
        if getattr(self, "servicer", None) is not None:
            await self.servicer.release_held()

    async def close(self) -> None:
        if getattr(self, "servicer", None) is not None:
            self.servicer.lines.close()
        self.core.close()
