"""Typed clients of one rollout replica: `RolloutClient` (blocking) and `AsyncRolloutClient` (asyncio)."""

from __future__ import annotations

from rlsync.client.base import AsyncClient, AsyncGenerating, SyncClient, SyncGenerating
from rlsync.common.v1 import weights_pb2
from rlsync.rollout.v1 import rollout_pb2 as pb
from rlsync.rollout.v1.rollout_pb2_grpc import RolloutServiceStub
from rlsync.transfer.v1 import transfer_pb2

PAUSE_MODES = {"abort": pb.PAUSE_MODE_ABORT, "keep": pb.PAUSE_MODE_KEEP, "wait": pb.PAUSE_MODE_WAIT}
WAKE_TAGS = {"weights": pb.WAKE_TAG_WEIGHTS, "kv_cache": pb.WAKE_TAG_KV_CACHE}


def pause_request(mode: str) -> pb.PauseRequest:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
    return pb.PauseRequest(mode=PAUSE_MODES[mode])


def wake_request(tags: tuple[str, ...]) -> pb.WakeUpRequest:
    unknown = set(tags) - set(WAKE_TAGS)
    if unknown:
        raise ValueError(f"wake tags must be among {sorted(WAKE_TAGS)}, got {sorted(unknown)}")
    return pb.WakeUpRequest(tags=[WAKE_TAGS[t] for t in tags])


class _RolloutMethods:
    """Unary RPCs; each returns the response (blocking client) or an awaitable (asyncio client)."""

    stub_class = RolloutServiceStub

    def abort(self, request_id: str):
        return self._call("Abort", pb.AbortRequest(request_id=request_id))

    def pause(self, mode: str = "abort"):
        return self._call("Pause", pause_request(mode))

    def resume(self):
        return self._call("Resume", pb.ResumeRequest())

    def sleep(self, level: int = 1):
        return self._call("Sleep", pb.SleepRequest(level=level))

    def wake_up(self, *tags: str):
        return self._call("WakeUp", wake_request(tags))

    def info(self, timeout: float | None = None):
        return self._call("GetInfo", pb.GetInfoRequest(), timeout=timeout)

    def prepare_update(self, offer: transfer_pb2.Offer, force_backend: str = "", timeout: float = 0):
        return self._call("PrepareUpdate", pb.PrepareUpdateRequest(offer=offer, force_backend=force_backend,
                                                                   timeout=timeout))

    def commit_update(self, version: int, force: bool = False, timeout: float = 0, recompute_kv: bool = False):
        request = pb.CommitUpdateRequest(version=version, force=force, timeout=timeout, recompute_kv=recompute_kv)
        return self._call("CommitUpdate", request, timeout=(timeout or 300) + 30)

    def abort_update(self):
        return self._call("AbortUpdate", pb.AbortUpdateRequest())

    def hold_weights(self, holder: str, mapped: transfer_pb2.MappedTensors, facts: transfer_pb2.Facts):
        """Keeps another process's CUDA storages on this replica's GPU mapped (see HoldWeights)."""
        return self._call("HoldWeights", pb.HoldWeightsRequest(holder=holder, mapped=mapped, facts=facts))

    def release_weights(self, holder: str):
        return self._call("ReleaseWeights", pb.ReleaseWeightsRequest(holder=holder))

    def checksums(self):
        return self._call("GetWeightChecksums", weights_pb2.GetWeightChecksumsRequest())


class RolloutClient(_RolloutMethods, SyncGenerating, SyncClient):
    """Blocking client. Errors raise rlsync.client.RpcError with the status code and message."""


class AsyncRolloutClient(_RolloutMethods, AsyncGenerating, AsyncClient):
    """asyncio client: `await client.info()`, `async for chunk in client.generate(...)`."""
