"""Shared-token access control: a server interceptor that refuses RPCs without the token."""

from __future__ import annotations

import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEADER = "authorization"

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - unreachable; makes this an async generator

    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(streaming if handler.response_streaming else unary,
                   request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC except health checks must carry `authorization: Bearer <token>`.

    Health stays open so orchestrators (docker, kubernetes) can probe without the secret.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        sent = dict(details.invocation_metadata or ()).get(HEADER)
        if sent is not None and hmac.compare_digest(sent.encode(), self._expected):
            return handler
        if sent is None:
            why = ("missing 'authorization' metadata: this server requires a token "
                   "(set RLSYNC_TOKEN, or pass token= to the rlsync client)")
        else:
            why = "wrong token in 'authorization' metadata (expected 'Bearer <token>' with the server's token)"
        return _refusal(handler, why)
