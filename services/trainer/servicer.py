"""gRPC face of the trainer core: protobuf <-> domain types, nothing else. The weight RPCs (offer,
publish, checksums, offload/onload) are rlsync.publish's, as for any trainer."""

from __future__ import annotations

from rlsync.publish.servicer import PublisherServicer
from rlsync.rpc import unary
from rlsync.trainer.core import Trajectory, TrainerCore
from rlsync.trainer.ranks import STALE_POLICIES
from rlsync.trainer.v1 import trainer_pb2 as pb


class TrainerServicer(PublisherServicer):
    def __init__(self, core: TrainerCore, token: str = ""):
        super().__init__(core.publisher, token=token)
        self.core = core

    def step(self) -> int:
        return self.core.step

    def state(self) -> pb.TrainerState:
        p = self.core.policy
        dtype = next(iter(p.specs.values()))[1] if p.specs else None
        return pb.TrainerState(step=self.core.step, model=self.core.model_path, device=str(p.device),
                               offloaded=p.offloaded, device_bytes=p.device_bytes(),
                               device_reserved_bytes=self.core.device_reserved(), parameters=p.numel(),
                               dtype=str(dtype).removeprefix("torch."))

    @unary
    async def Train(self, request: pb.TrainRequest, context) -> pb.TrainResponse:
        r = await self.core.train(
            [Trajectory.from_proto(t) for t in request.trajectories],
            request.max_staleness if request.HasField("max_staleness") else None,
            STALE_POLICIES.get(request.stale_policy),
            request.stale_weight if request.HasField("stale_weight") else None)
        return pb.TrainResponse(step=r.step, metrics=r.metrics, trajectories_used=r.used, stale=r.stale,
                                dropped=r.dropped)

    @unary
    async def SaveCheckpoint(self, request: pb.SaveCheckpointRequest, context) -> pb.SaveCheckpointResponse:
        path = await self.core.save(request.path)
        return pb.SaveCheckpointResponse(path=path, step=self.core.step)

    @unary
    async def LoadCheckpoint(self, request: pb.LoadCheckpointRequest, context) -> pb.LoadCheckpointResponse:
        return pb.LoadCheckpointResponse(step=await self.core.load(request.path))
