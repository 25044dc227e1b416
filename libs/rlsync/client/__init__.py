"""rlsync's client SDK: typed, blocking and asyncio clients of the rlsync services.

Blocking clients return responses; asyncio clients (Async*) return awaitables with the same
names. Every failed call raises RpcError carrying the gRPC status code and the server's message.
"""

from rlsync.client.completion import Completion, collect, generate_request
from rlsync.client.coordinator import AsyncCoordinatorClient, CoordinatorClient
from rlsync.client.errors import Gone, RpcError
from rlsync.client.rollout import AsyncRolloutClient, RolloutClient
from rlsync.client.trainer import AsyncTrainerClient, TrainerClient, trajectory
from rlsync.client.weights import (PushReport, abort_staged_async, commit_staged, commit_staged_async, push_weights,
                                   push_weights_async, stage_weights, stage_weights_async)

__all__ = ["AsyncCoordinatorClient", "AsyncRolloutClient", "AsyncTrainerClient", "Completion", "CoordinatorClient",
           "Gone", "PushReport", "RolloutClient", "RpcError", "TrainerClient", "collect", "generate_request",
           "push_weights", "push_weights_async", "stage_weights", "commit_staged", "stage_weights_async",
           "commit_staged_async", "abort_staged_async", "trajectory"]
