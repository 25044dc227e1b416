"""Errors that are part of the API: each maps to one gRPC status code and carries an actionable message."""

from __future__ import annotations

import grpc


class RlsyncError(Exception):
    """Base class; `code` is the gRPC status a servicer answers with."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(RlsyncError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RlsyncError):
    """The call is valid but not in the current state (asleep, paused, stale version)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unmappable(FailedPrecondition):
    """The sender's CUDA memory cannot be mapped here (another GPU than its facts said, no IPC permission
    between two containers): nothing was read, so the handshake may choose another channel."""


class NotFound(RlsyncError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(RlsyncError):
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(RlsyncError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(RlsyncError):
    """Try again later or elsewhere: shutting down, no replica, peer gone."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhausted(RlsyncError):
    """Out of memory (or another resource) on the serving side."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Aborted(RlsyncError):
    code = grpc.StatusCode.ABORTED


class DataLoss(RlsyncError):
    """Bytes arrived corrupted or truncated."""

    code = grpc.StatusCode.DATA_LOSS


class EngineDead(RlsyncError):
    """The inference engine failed and cannot serve; the replica must be restarted."""

    code = grpc.StatusCode.INTERNAL


class AlreadyExists(RlsyncError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Relayed(RlsyncError):
    """An error another service answered with, passed on with its own status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
