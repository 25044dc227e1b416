"""rlsync's client SDK: typed, blocking and asyncio clients of the rlsync services."""

from rlsync.client.completion import Completion, collect, generate_request
from rlsync.client.errors import RpcError
from rlsync.client.rollout import AsyncRolloutClient, RolloutClient

__all__ = ["AsyncRolloutClient", "Completion", "RolloutClient", "RpcError", "collect", "generate_request"]
