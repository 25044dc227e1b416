"""gRPC face of the trainer core: protobuf <-> domain types, nothing else."""

from __future__ import annotations

from rlsync.common.audit import LIVE, to_proto as checksums_to_proto
from rlsync.common.v1 import weights_pb2
from rlsync.rpc import unary
from rlsync.trainer.core import Trajectory, TrainerCore
from rlsync.trainer.v1 import trainer_pb2 as pb
from rlsync.trainer.v1 import trainer_pb2_grpc

_STALE = {pb.STALE_POLICY_KEEP: "keep", pb.STALE_POLICY_DROP: "drop", pb.STALE_POLICY_DOWNWEIGHT: "downweight"}


def trajectory_from_proto(t: pb.Trajectory) -> Trajectory:
    return Trajectory(list(t.prompt_ids), list(t.completion_ids), t.reward,
                      t.advantage if t.HasField("advantage") else None, list(t.behavior_logprobs),
                      list(t.token_versions), t.group_id)


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, core: TrainerCore):
        self.core = core

    def _state(self) -> pb.TrainerState:
        p = self.core.policy
        dtype = next(iter(p.specs.values()))[1] if p.specs else None
        return pb.TrainerState(step=self.core.step, model=self.core.model_path, device=str(p.device),
                               offloaded=p.offloaded, device_bytes=p.device_bytes(),
                               device_reserved_bytes=self.core.device_reserved(), parameters=p.numel(),
                               dtype=str(dtype).removeprefix("torch."))

    @unary
    async def Train(self, request: pb.TrainRequest, context) -> pb.TrainResponse:
        r = await self.core.train(
            [trajectory_from_proto(t) for t in request.trajectories],
            request.max_staleness if request.HasField("max_staleness") else None,
            _STALE.get(request.stale_policy), request.stale_weight if request.HasField("stale_weight") else None)
        return pb.TrainResponse(step=r.step, metrics=r.metrics, trajectories_used=r.used, stale=r.stale,
                                dropped=r.dropped)

    @unary
    async def GetState(self, request, context) -> pb.TrainerState:
        return self._state()

    @unary
    async def Offload(self, request, context) -> pb.OffloadResponse:
        await self.core.offload()
        return pb.OffloadResponse(state=self._state())

    @unary
    async def Onload(self, request, context) -> pb.OnloadResponse:
        await self.core.onload()
        return pb.OnloadResponse(state=self._state())

    @unary
    async def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context) -> pb.SaveCheckpointResponse:
        path = await self.core.save(request.path)
        return pb.SaveCheckpointResponse(path=path, step=self.core.step)

    @unary
    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest, context) -> pb.LoadCheckpointResponse:
        return pb.LoadCheckpointResponse(step=await self.core.load(request.path))

    @unary
    async def OfferWeights(self, request: pb.OfferWeightsRequest, context):
        return self.core.offer(request.version if request.HasField("version") else None)

    @unary
    async def PublishWeights(self, request: pb.PublishWeightsRequest, context) -> pb.PublishWeightsResponse:
        version, report = await self.core.publish(request.transfer_id, list(request.answers), request.timeout)
        return pb.PublishWeightsResponse(version=version, bytes=report.nbytes, seconds=report.seconds,
                                         data_seconds=report.data_seconds, backends=report.backends,
                                         profile=report.profile)

    @unary
    async def GetWeightChecksums(self, request: weights_pb2.GetWeightChecksumsRequest, context):
        return checksums_to_proto(self.core.step, self.core.checksums(request.dtype), LIVE)
