"""Wires the trainer core to gRPC and to the shared serving lifecycle."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rlsync.config import describe
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
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(self.core), server)

    async def drain(self, reason: str) -> None:
        async with self.core.lock:  # let a running step or publish finish
            pass

    async def close(self) -> None:
        self.core.close()
