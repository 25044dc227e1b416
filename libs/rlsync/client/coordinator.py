"""Typed clients of the coordinator (the one address an orchestration script needs):
`CoordinatorClient` (blocking) and `AsyncCoordinatorClient` (asyncio)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc

from rlsync.client.base import AsyncClient, AsyncGenerating, SyncClient, SyncGenerating
from rlsync.client.errors import RpcError
from rlsync.client.trainer import train_request
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.coordinator.v1.coordinator_pb2_grpc import CoordinatorServiceStub
from rlsync.trainer.v1 import trainer_pb2


class _CoordinatorMethods:
    stub_class = CoordinatorServiceStub

    def abort(self, request_id: str):
        return self._call("Abort", pb.AbortRequest(request_id=request_id))

    def train(self, trajectories: Iterable[trainer_pb2.Trajectory], max_staleness: int | None = None,
              stale_policy: str = "", stale_weight: float | None = None):
        """One training step (colocated: engines sleep and the trainer onloads first)."""
        return self._call("Train", train_request(trajectories, max_staleness, stale_policy, stale_weight),
                          timeout=3600)

    def sync_weights(self, version: int | None = None, force_backend: str = "", verify: bool = False):
        return self._call("SyncWeights", pb.SyncWeightsRequest(version=version, force_backend=force_backend,
                                                               verify=verify), timeout=3600)

    def status(self):
        return self._call("GetStatus", pb.GetStatusRequest())


class CoordinatorClient(_CoordinatorMethods, SyncGenerating, SyncClient):
    """Blocking client: generation through the gateway, training, weight syncs, fleet status."""

    def wait_ready(self, count: int, timeout: float = 60.0) -> list[pb.Member]:
        """Waits until exactly `count` members (trainer and replicas) are ready; returns them. A
        coordinator that is still starting (or restarting) is waited for too, within the same `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                members, unreachable = self.status().members, ""
            except RpcError as e:  # not listening yet: GetStatus waited for it (30 s at most) in vain
                if e.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                members, unreachable = [], str(e)
            ready = [m for m in members if m.state == "ready"]
            if not unreachable and len(ready) == count:
                return ready
            if time.monotonic() > deadline:
                raise TimeoutError(f"expected {count} ready members within {timeout:.0f}s: " + (
                    f"the coordinator at {self.address} does not answer ({unreachable})" if unreachable else
                    f"have {len(ready)}: {[(m.address, m.state) for m in members]}"))
            time.sleep(0.1)


class AsyncCoordinatorClient(_CoordinatorMethods, AsyncGenerating, AsyncClient):
    """asyncio client with the same methods."""
