"""Maps domain exceptions to gRPC statuses for servicer methods: thin servicers stay thin."""

from __future__ import annotations

import functools
import logging

import grpc

from rlsync.client.errors import RpcError
from rlsync.errors import RlsyncError

log = logging.getLogger(__name__)


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a call that raised `exc` answers with (an unexpected error is logged)."""
    if isinstance(exc, RlsyncError):
        return exc.code, str(exc)
    if isinstance(exc, RpcError):  # another service's answer, passed on with its own status
        return exc.code, f"{exc.method}: {exc.message}" if exc.method else exc.message
    log.error("unexpected error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    await context.abort(*status_of(exc, method))


def unary(method):
    """For `async def Method(self, request, context) -> response`."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc, method.__qualname__)

    return wrapper


def streaming(method):
    """For `async def Method(self, request, context)` that yields responses."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, method.__qualname__)

    return wrapper
