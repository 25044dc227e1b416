"""One exception type for every failed call, carrying the gRPC status and the server's message."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class RpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, method: str = ""):
        hint = (" (retryable: the service, or a peer it needed, was unavailable; try again later)"
                if code == grpc.StatusCode.UNAVAILABLE else "")
        super().__init__(f"{method}: {code.name}: {message}{hint}" if method else f"{code.name}: {message}{hint}")
        self.code = code
        self.message = message
        self.method = method

    @property
    def retryable(self) -> bool:
        """The call did not reach a live service (or the service lacked a peer): trying again later
        may succeed, as when a replica or the coordinator restarts. The SDK's clients already retried
        calls that may run twice."""
        return self.code == grpc.StatusCode.UNAVAILABLE


class Gone(RpcError):
    """The call was abandoned because its caller learnt the service is gone (the coordinator's
    registry, when the service's lease ran out): UNAVAILABLE, as for a service that died. A hung
    process gets no other answer."""

    def __init__(self, why: str, method: str = ""):
        super().__init__(grpc.StatusCode.UNAVAILABLE, why, method)


@contextlib.contextmanager
def translated(method: str) -> Iterator[None]:
    """Re-raises grpc errors as RpcError(code, message)."""
    try:
        yield
    except grpc.RpcError as e:  # both sync and aio errors implement code()/details()
        raise RpcError(e.code(), e.details() or "", method) from None
