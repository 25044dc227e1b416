"""An HTTP server beside a service's gRPC one, in the same event loop (uvicorn serving an ASGI app):
bound like gRPC (same host, TLS files), announced with one JSON line like gRPC's `listening`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import uvicorn

from rlsync.address import advertised
from rlsync.config import ServerConfig

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the service's own SIGTERM handling stops it (HttpServer.stop)


class HttpServer:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task, address: str):
        self.server, self.task, self.address = server, task, address

    async def stop(self) -> None:
        """Stops accepting, gives requests in flight the grace period, then ends them."""
        self.server.should_exit = True
        await self.task


async def serve_http(app, cfg: ServerConfig, port: int, what: str = "http") -> HttpServer:
    """Serves `app` on cfg.host:port (0: a free port); returns once it accepts connections."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                            ssl_certfile=cfg.tls_cert or None, ssl_keyfile=cfg.tls_key or None,
                            timeout_graceful_shutdown=cfg.grace_seconds)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
        await asyncio.sleep(0.01)
    address = advertised(cfg.host, sock.getsockname()[1], "")
    print(json.dumps({"event": what, "address": address}), flush=True)
    log.info("%s listening on http%s://%s", what, "s" if cfg.tls_cert else "", address)
    return HttpServer(server, task, address)
