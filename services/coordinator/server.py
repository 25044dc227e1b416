"""Wires the coordinator to gRPC and to the shared serving lifecycle."""

from __future__ import annotations

import logging

import grpc

from rlsync.config import describe
from rlsync.rpc.http import HttpServer
from rlsync.rpc.server import serve_http_on
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.core import Coordinator
from rlsync.coordinator.openai_api import make_app
from rlsync.coordinator.servicer import CoordinatorServicer
from rlsync.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


class CoordinatorService:
    name = "coordinator"
    service_names = [coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name]

    def __init__(self, cfg: CoordinatorConfig):
        self.cfg = cfg
        self.core = Coordinator(cfg)
        self.http: HttpServer | None = None

    async def start(self) -> None:
        log.info("starting coordinator: %s", describe(self.cfg))
        await self.core.start()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(CoordinatorServicer(self.core), server)

    async def serving(self, host: str, port: int) -> None:
        if self.cfg.http_port >= 0:
            self.http = await serve_http_on(make_app(self.core.gateway, self.cfg.served_model_name,
                                                     self.cfg.server.token), self.cfg.server, self.cfg.http_port,
                                            "http_port")

    async def drain(self, reason: str) -> None:
        # Gateway streams end with the servers' grace periods (HTTP first); replicas keep their own.
        if self.http is not None:
            await self.http.stop()
            self.http = None

    async def close(self) -> None:
        await self.core.close()
