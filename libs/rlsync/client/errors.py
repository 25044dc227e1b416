"""One exception type for every failed call, carrying the gRPC status and the server's message."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class RpcError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, method: str = ""):
        super().__init__(f"{method}: {code.name}: {message}" if method else f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.method = method


@contextlib.contextmanager
def translated(method: str) -> Iterator[None]:
    """Re-raises grpc errors as RpcError(code, message)."""
    try:
        yield
    except grpc.RpcError as e:  # both sync and aio errors implement code()/details()
        raise RpcError(e.code(), e.details() or "", method) from None
