"""The serving lifecycle every rlsync service shares: bind, health, reflection, auth, graceful shutdown.

Shutdown order on SIGTERM/SIGINT: health NOT_SERVING -> the service ends in-flight work with a
reason (streams finish with it instead of breaking) -> server.stop(grace) -> the service closes its
engine or workers. The process then exits with nothing left behind. A service whose `failure()`
returns (its engine died) turns NOT_SERVING at once and stays up to say why.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from rlsync.common.metrics import metrics_app
from rlsync.config import ServerConfig
from rlsync.checks import StartupError, bind_problem, bind_refusal
from rlsync.rpc.http import serve_http
from rlsync.rpc.auth import TokenAuthInterceptor
from rlsync.address import advertised

log = logging.getLogger(__name__)


class Service(Protocol):
    """What a service hands to `run_service`."""

    #: Short name for logs ("rollout").
    name: str
    #: Full names of its gRPC services, for health and reflection.
    service_names: list[str]

    def add_to_server(self, server: grpc.aio.Server) -> None: ...

    async def start(self) -> None:
        """Brings up engines or workers; an exception here ends the process before it binds."""

    async def serving(self, host: str, port: int) -> None:
        """Called once the server listens (services register with the coordinator here)."""

    async def drain(self, reason: str) -> None:
        """Ends in-flight work (streams finish with `reason`)."""

    async def close(self) -> None:
        """Releases engines and workers once the server has stopped."""

    # Optional: `async def failure(self) -> str` returns (with the reason) once the service can no
    # longer do its work; run_service then reports NOT_SERVING.


def server_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def _bind(server: grpc.aio.Server, cfg: ServerConfig) -> int:
    """Binds cfg.host:cfg.port; one that cannot be bound (taken since the check at start-up, or never
    checked: a caller of run_service) is refused in one line that names the port and its flag."""
    address = f"{cfg.host}:{cfg.port}"
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise StartupError("TLS needs both --tls-cert and --tls-key")
    try:
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.60: "Failed to bind to address ..."; older ones return 0
        port = 0
    if port == 0:
        raise bind_refusal(cfg.host, cfg.port, "port", bind_problem(cfg.host, cfg.port))
    return port


async def serve_http_on(app, cfg: ServerConfig, port: int, name: str, what: str = "http"):
    """serve_http, with a port that cannot be bound refused like the gRPC one (name: its field)."""
    try:
        return await serve_http(app, cfg, port, what)
    except OSError as e:
        raise bind_refusal(cfg.host, port, name, e) from None


async def run_service(cfg: ServerConfig, service: Service, stop: asyncio.Event | None = None) -> None:
    """Serves `service` until SIGTERM/SIGINT (or `stop` is set), then shuts down in order."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def stop_on_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    stop_on_signals()
    await service.start()
    stop_on_signals()  # again: an engine may put its own in place while it starts (SGLang's drains and exits)
    server, metrics = None, None
    try:  # from here on, a failure to start (a port taken meanwhile) still closes what start() opened
        interceptors = [TokenAuthInterceptor(cfg.token)] if cfg.token else []
        server = grpc.aio.server(interceptors=interceptors, options=server_options(cfg))
        service.add_to_server(server)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        for name in ["", *service.service_names]:
            await health.set(name, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(
            [*service.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        port = _bind(server, cfg)
        await server.start()
        # One machine-readable line on stdout: scripts, launchers and tests wait for it.
        address = advertised(cfg.host, port, cfg.advertise)
        print(json.dumps({"event": "listening", "service": service.name, "address": address}), flush=True)
        log.info("%s listening on %s:%d (others dial %s)%s", service.name, cfg.host, port, address,
                 " (TLS)" if cfg.tls_cert else "")
        await service.serving(cfg.host, port)
        if cfg.metrics_port >= 0:
            metrics = await serve_http_on(metrics_app(), cfg, cfg.metrics_port, "metrics_port", "metrics")
        watch = asyncio.create_task(_not_serving_on_failure(service, health)) if hasattr(service, "failure") else None

        await stop.wait()
        if watch is not None:
            watch.cancel()
        log.info("%s shutting down", service.name)
        await health.enter_graceful_shutdown()
        await service.drain(f"{service.name} is shutting down")
    finally:
        if server is not None:
            await server.stop(cfg.grace_seconds)
        if metrics is not None:
            await metrics.stop()
        await service.close()
    log.info("%s stopped", service.name)


async def _not_serving_on_failure(service: Service, health: HealthServicer) -> None:
    reason = await service.failure()
    log.error("%s can no longer serve: %s", service.name, reason)
    for name in ["", *service.service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_main(prog: str, doc: str | None, config_cls: type, make_service, argv: list[str] | None = None,
               extra_arguments=None, adjust=None) -> int:
    """The `python -m rlsync.<service>` entry point every service shares: flags -> typed config ->
    serve until SIGTERM. A refused argument, or a value it cannot start with (a missing model, a port
    in use: StartupError, checked before anything loads), or an engine's refusal of its arguments
    (RlsyncError) exits with status 2 and one line, `<prog>: error: <reason>`, as argparse's own do."""
    import argparse

    from rlsync.config import add_arguments, build, validate
    from rlsync.errors import RlsyncError

    parser = argparse.ArgumentParser(prog=prog, description=doc)
    add_arguments(parser, config_cls)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = build(config_cls, args)
        if adjust:
            adjust(cfg, args)
        validate(cfg)
        setup_logging(cfg.server.log_level)
        faulthandler.enable(all_threads=True)  # a fatal signal leaves its name and stacks in the log
        asyncio.run(run_service(cfg.server, make_service(cfg)))
    except (StartupError, RlsyncError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
