"""gRPC plumbing shared by every service and client: serving lifecycle, auth, status mapping, channels."""

from rlsync.rpc.channel import aio_channel, sync_channel
from rlsync.rpc.server import Service, run_service
from rlsync.rpc.status import unary, streaming

__all__ = ["Service", "run_service", "aio_channel", "sync_channel", "unary", "streaming"]
