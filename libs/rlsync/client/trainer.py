"""Typed clients of the trainer: `TrainerClient` (blocking) and `AsyncTrainerClient` (asyncio)."""

from __future__ import annotations

from collections.abc import Iterable

from rlsync.client.base import AsyncClient, SyncClient
from rlsync.client.completion import Completion
from rlsync.common.v1 import weights_pb2
from rlsync.trainer.v1 import trainer_pb2 as pb
from rlsync.trainer.v1.trainer_pb2_grpc import TrainerServiceStub
from rlsync.transfer.v1 import transfer_pb2

STALE_POLICIES = {"keep": pb.STALE_POLICY_KEEP, "drop": pb.STALE_POLICY_DROP, "downweight": pb.STALE_POLICY_DOWNWEIGHT}


def trajectory(completion: Completion, reward: float, group_id: str = "",
               advantage: float | None = None) -> pb.Trajectory:
    """A training trajectory from a finished completion (prompt, tokens, logprobs, their versions)."""
    return pb.Trajectory(prompt_ids=completion.prompt_token_ids, completion_ids=completion.token_ids,
                         reward=reward, behavior_logprobs=completion.logprobs,
                         token_versions=completion.token_versions, group_id=group_id, advantage=advantage)


def train_request(trajectories: Iterable[pb.Trajectory], max_staleness: int | None = None,
                  stale_policy: str = "", stale_weight: float | None = None) -> pb.TrainRequest:
    if stale_policy and stale_policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy must be one of {sorted(STALE_POLICIES)}")
    return pb.TrainRequest(trajectories=list(trajectories), max_staleness=max_staleness,
                           stale_policy=STALE_POLICIES.get(stale_policy, 0), stale_weight=stale_weight)


class _TrainerMethods:
    stub_class = TrainerServiceStub

    def train(self, trajectories: Iterable[pb.Trajectory], max_staleness: int | None = None,
              stale_policy: str = "", stale_weight: float | None = None):
        return self._call("Train", train_request(trajectories, max_staleness, stale_policy, stale_weight),
                          timeout=600)

    def state(self):
        return self._call("GetState", pb.GetStateRequest())

    def offload(self):
        """-> OffloadResponse (replicas holding the weights mapped let go of them first)."""
        return self._call("Offload", pb.OffloadRequest())

    def onload(self, ring: Iterable[transfer_pb2.Doorbell] = ()):
        """-> OnloadResponse. ring: replicas' doorbells; those on the trainer's GPU map its weights
        now and hold them until it offloads (see OnloadRequest.ring)."""
        return self._call("Onload", pb.OnloadRequest(ring=list(ring)))

    def save_checkpoint(self, path: str):
        return self._call("SaveCheckpoint", pb.SaveCheckpointRequest(path=path), timeout=600)

    def load_checkpoint(self, path: str):
        return self._call("LoadCheckpoint", pb.LoadCheckpointRequest(path=path), timeout=600)

    def offer_weights(self, version: int | None = None, pull: bool = False,
                      ring: Iterable[transfer_pb2.Doorbell] = (), force_backend: str = "", timeout: float = 0,
                      hold: bool = False, publish: bool = False, fmt: transfer_pb2.WeightFormat | None = None):
        """-> OfferWeightsResponse. pull: see OfferWeightsRequest.pull (only while nothing trains until
        every replica prepared). ring: replicas' doorbells the trainer hands the offer to, when on its
        host (force_backend and timeout are theirs). hold: those on its GPU keep its weights mapped
        from now on (OfferWeightsRequest.hold). publish: `ring` is every replica: once all prepared,
        the trainer sends at once (OfferWeightsRequest.publish; PublishWeights then collects it). fmt: the format
        the replicas hold their weights in (RolloutInfo.weight_format): the trainer quantizes to it."""
        request = pb.OfferWeightsRequest(version=version, pull=pull, ring=list(ring), force_backend=force_backend,
                                         timeout=timeout, hold=hold, publish=publish, format=fmt)
        # Longer than the trainer's rings ((timeout or 300) + 30), so a silent replica's own error comes back.
        return self._call("OfferWeights", request, timeout=(timeout or 300) + 60 if request.ring else None)

    def publish_weights(self, transfer_id: str, answers: Iterable[transfer_pb2.Answer], timeout: float = 0):
        return self._call("PublishWeights", pb.PublishWeightsRequest(transfer_id=transfer_id, answers=list(answers),
                                                                     timeout=timeout), timeout=(timeout or 300) + 30)

    def checksums(self, dtype: str = ""):
        return self._call("GetWeightChecksums", weights_pb2.GetWeightChecksumsRequest(dtype=dtype))


class TrainerClient(_TrainerMethods, SyncClient):
    """Blocking client. Errors raise rlsync.client.RpcError with the status code and message."""


class AsyncTrainerClient(_TrainerMethods, AsyncClient):
    """asyncio client: `await client.train(...)`."""
