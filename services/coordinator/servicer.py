"""gRPC face of the coordinator: protobuf in, protobuf out, errors as statuses."""

from __future__ import annotations

from rlsync.common.v1 import generate_pb2 as gen_pb
from rlsync.coordinator.core import MODES, Coordinator
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.coordinator.v1 import coordinator_pb2_grpc
from rlsync.rpc import streaming, unary


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, core: Coordinator):
        self.core = core

    @streaming
    async def Generate(self, request: gen_pb.GenerateRequest, context):
        async for chunk in self.core.gateway.generate(request):
            yield chunk

    @unary
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        await self.core.gateway.abort(request.request_id)
        return pb.AbortResponse()

    @unary
    async def Train(self, request, context):
        return await self.core.train(request)

    @unary
    async def SyncWeights(self, request: pb.SyncWeightsRequest, context) -> pb.SyncWeightsResponse:
        r = await self.core.syncer.sync(request.version if request.HasField("version") else None,
                                        request.force_backend, request.verify)
        return pb.SyncWeightsResponse(version=r.version, mode=MODES[self.core.cfg.sync_mode], phases=r.phases,
                                      seconds=r.seconds, replicas=r.replicas, bytes=r.bytes, backends=r.backends,
                                      verified=r.verified, transfer_profile=r.transfer_profile,
                                      wire_bytes=r.wire_bytes, trainer_rank_bytes=r.trainer_rank_bytes)

    @unary
    async def GetStatus(self, request, context) -> pb.FleetStatus:
        return self.core.status()

    @unary
    async def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:
        member_id = self.core.register(request.role, request.address, request.name)
        return pb.RegisterResponse(member_id=member_id, heartbeat_interval=self.core.cfg.heartbeat_interval,
                                   lease=self.core.cfg.lease)

    @unary
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(known=self.core.registry.heartbeat(request.member_id, request.progress,
                                                                      request.cpu_seconds))

    @unary
    async def Deregister(self, request: pb.DeregisterRequest, context) -> pb.DeregisterResponse:
        if request.reason:
            self.core.registry.lose(request.member_id, request.reason, "left")
        else:
            self.core.registry.remove(request.member_id, "deregistered")
        return pb.DeregisterResponse()
