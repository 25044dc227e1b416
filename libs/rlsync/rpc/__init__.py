"""gRPC plumbing shared by every service and client: serving lifecycle, auth, status mapping, channels.

Its names load on first use (a member's beacon, rlsync.rpc.beacon, needs a channel and no server)."""

import importlib

_WHERE = {"aio_channel": "channel", "sync_channel": "channel", "Service": "server", "run_service": "server",
          "unary": "status", "streaming": "status"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rlsync.rpc' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlsync.rpc.{_WHERE[name]}"), name)
