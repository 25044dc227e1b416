"""Wires the coordinator to gRPC and to the shared serving lifecycle."""

from __future__ import annotations

import logging

import grpc

from rlsync.config import describe
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.core import Coordinator
from rlsync.coordinator.servicer import CoordinatorServicer
from rlsync.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


class CoordinatorService:
    name = "coordinator"
    service_names = [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        self.core = Coordinator(cfg)

    async def start(self) -> None:
        log.info("starting coordinator: %s", describe(self.cfg))
        await self.core.start()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(self.core), server)

    async def serving(self, host: str, port: int) -> None:
        pass

    async def drain(self, reason: str) -> None:
        pass  # gateway streams end with the server's grace period; replicas keep their own requests

    async def close(self) -> None:
        await self.core.close()
