"""Client channels to rlsync services: token metadata, optional TLS, the same message limits as servers."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from rlsync.rpc.auth import HEADER

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


# Calls that may safely run twice are retried by gRPC itself when the service is unreachable (a
# replica or coordinator restarting): a few attempts with backoff, about 3 s in all. The
# coordinator's status also waits for the channel to connect, up to 30 s, so a script polling it
# rides out a coordinator restart. Everything else fails fast with UNAVAILABLE (RpcError.retryable).
# The coordinator's clients of its members do not retry: heartbeats say who is alive, and a sync
# must learn at once that a replica is gone.
IDEMPOTENT = {
    "rlsync.rollout.v1.RolloutService": ["GetInfo", "GetWeightChecksums", "Resume", "WakeUp", "AbortUpdate"],
    "rlsync.trainer.v1.TrainerService": ["GetState", "GetWeightChecksums"],
    "rlsync.coordinator.v1.CoordinatorService": ["Heartbeat"],
}
_RETRY = {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "2s", "backoffMultiplier": 2,
          "retryableStatusCodes": ["UNAVAILABLE"]}
SERVICE_CONFIG = json.dumps({"methodConfig": [
    {"name": [{"service": service, "method": m} for service, methods in IDEMPOTENT.items() for m in methods],
     "retryPolicy": _RETRY},
    {"name": [{"service": "rlsync.coordinator.v1.CoordinatorService", "method": "GetStatus"}],
     "retryPolicy": _RETRY, "waitForReady": True, "timeout": "30s"},
]})


def _options(max_message_bytes: int, retries: bool = True) -> list[tuple[str, int | str]]:
    limits = [("grpc.max_receive_message_length", max_message_bytes),
              ("grpc.max_send_message_length", max_message_bytes)]
    if not retries:  # gRPC's transparent retries (a call that never left) stay on
        return limits
    return [*limits, ("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]


def _credentials(tls_ca: str | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(Path(tls_ca).read_bytes() if tls_ca else None)


class _TokenMetadata(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._metadata = ((HEADER, f"Bearer {token}"),)

    def __call__(self, context, callback):
        callback(self._metadata, None)


class _AioToken:
    """Adds the token to every call on an insecure channel (call credentials need TLS). One object
    per call kind: an aio channel files an interceptor under the first kind it is an instance of,
    so one object of both kinds would leave streams (Generate) without the token."""

    def __init__(self, token: str):
        self._pair = (HEADER, f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return details._replace(metadata=metadata)


class _AioUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _AioStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


def aio_channel(address: str, token: str = "", tls: bool = False, tls_ca: str | None = None,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                retries: bool = True) -> grpc.aio.Channel:
    options = _options(max_message_bytes, retries)
    if tls:
        creds = _credentials(tls_ca)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_TokenMetadata(token)))
        return grpc.aio.secure_channel(address, creds, options=options)
    interceptors = [_AioUnaryToken(token), _AioStreamToken(token)] if token else None
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self._pair = (HEADER, f"Bearer {token}")

    def _with_token(self, details):
        return _Details(details.method, details.timeout, [*(details.metadata or ()), self._pair],
                        details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def sync_channel(address: str, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 retries: bool = True) -> grpc.Channel:
    options = _options(max_message_bytes, retries)
    if tls:
        creds = _credentials(tls_ca)
        if token:
            creds = grpc.composite_channel_credentials(creds, grpc.metadata_call_credentials(_TokenMetadata(token)))
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _SyncToken(token)) if token else channel
