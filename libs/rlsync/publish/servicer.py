"""The weight RPCs of TrainerService over a PublisherCore: protobuf <-> domain types, nothing else.

rlsync's trainer service extends this with Train and checkpoints; a user's loop serves it as is
(Train answers FAILED_PRECONDITION: that trainer trains in its own loop).
"""

from __future__ import annotations

import asyncio

from rlsync.client.weights import ring_prepare
from rlsync.common.audit import LIVE, to_proto as checksums_to_proto
from rlsync.common.stamps import stamp
from rlsync.common.v1 import weights_pb2
from rlsync.errors import FailedPrecondition
from rlsync.publish.core import PublisherCore
from rlsync.publish.holders import Holders
from rlsync.rpc import unary
from rlsync.rpc.doorbell import Lines
from rlsync.trainer.v1 import trainer_pb2 as pb
from rlsync.trainer.v1 import trainer_pb2_grpc
from rlsync.transfer.v1 import transfer_pb2 as tpb


class PublisherServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, publisher: PublisherCore, describe=None, token: str = "", holder: str = "trainer"):
        self.publisher = publisher
        self.describe = describe  # () -> dict of TrainerState fields beside step and offloaded
        self.token = token  # the fleet's: rung replicas check it as their gRPC servers do
        self.lines = Lines()  # connections to the replicas' doorbells, kept between updates
        self.holders = Holders(holder, token, self.lines)  # the replicas that keep the weights mapped

    def state(self) -> pb.TrainerState:
        return pb.TrainerState(step=self.publisher.published, offloaded=self.publisher.offloaded,
                               **(self.describe() if self.describe else {}))

    def step(self) -> int:
        """The version the trainer's current weights would be published as."""
        return self.publisher.current

    @unary
    async def Train(self, request, context):
        raise FailedPrecondition("this trainer trains in its own loop (rlsync.publish.WeightPublisher): send "
                                 "trajectories to it directly, not through the coordinator's Train")

    @unary
    async def GetState(self, request, context) -> pb.TrainerState:
        return self.state()

    @unary
    async def Offload(self, request, context) -> pb.OffloadResponse:
        await self.publisher.settle()  # a send queued before: its replicas hold what they pull once it ran
        released = await self.release_held()
        await self.publisher.offload()
        return pb.OffloadResponse(state=self.state(), released=released)

    @unary
    async def Onload(self, request: pb.OnloadRequest, context) -> pb.OnloadResponse:
        onloaded = await self.publisher.onload(describe=len(request.ring) > 0)
        if onloaded is not None:  # replicas on this GPU map the weights while training runs
            # (mapped anew at each onload; a sharded trainer's memories read ahead of its offers)
            await self.holders.hold(onloaded[:2], list(request.ring), peers=False, routing=onloaded[2])
            if self.publisher.offloaded:  # an Offload ran while they mapped: they let go now
                await self.release_held()
        return pb.OnloadResponse(state=self.state(), held=len(self.holders.holding))

    async def release_held(self) -> int:
        """Has every replica that holds the weights mapped let go (before they leave the GPU, and when the
        trainer leaves: a replica that maps a process's memory keeps it on the GPU after that process ends)."""
        return await self.holders.release()

    @unary
    async def OfferWeights(self, request: pb.OfferWeightsRequest, context) -> pb.OfferWeightsResponse:
        ring = list(request.ring)
        offer, regions = await self.publisher.offer(request.version if request.HasField("version") else self.step(),
                                                    request.pull, describe=request.hold and bool(ring),
                                                    fmt=request.format if request.HasField("format") else None)
        publishing = False
        try:
            if regions is not None:
                # Replicas keep the weights mapped from one update to the next, in every mode (they stay where
                # they are until an Offload, which has them let go first); those on another GPU pull them only
                # where training goes on meanwhile, and only a copy of bytes (no cast).
                await self.holders.hold(regions, ring, peers=not request.pull)
                if self.publisher.offloaded:  # an Offload ran while they mapped: they let go now
                    await self.release_held()
                if offer.one_copy and not offer.mapped.dtype:
                    offer.peer_readers.extend(self.holders.peer_readers(regions))
            rung_offer = self._rung_offer(offer, ring) if request.hold and ring else offer
            rang = asyncio.ensure_future(ring_prepare(rung_offer, ring, self.token, request.force_backend,
                                                      request.timeout, self.lines, self.holders.bells_for(rung_offer),
                                                      self.publisher.final(offer.transfer_id)))
            if request.publish and ring:
                # A trainer that sends as soon as the replicas it rang answered starts broadcasting while they
                # prepare, on the group of their last update: those that post their receives as they prepare
                # get the bytes at once (rlsync.transfer.backends.groups).
                ahead = asyncio.ensure_future(self._send_ahead(offer.transfer_id))
                try:
                    await asyncio.shield(ahead)
                except BaseException:  # cancelled: what the thread still posts is ended once it has
                    rang.cancel()
                    ahead.add_done_callback(lambda t: (t.cancelled() or t.exception(),
                                                       self.publisher.cancel_ahead(offer.transfer_id)))
                    raise
            rung, seconds = await rang
            pushed = [r.answer for r in rung if not r.answer.pull]
            if offer.HasField("routing") and rung and all(r.rung for r in rung) and not pushed:
                self.publisher.settled(offer.transfer_id)  # each copied as it prepared (Routing.memories)
            publishing = request.publish and all(r.rung for r in rung) and bool(pushed)
            if publishing:  # every replica prepared here: send now, rather than at PublishWeights
                self.publisher.publish_now(offer.transfer_id, pushed, request.timeout)
        finally:
            if not publishing:
                self.publisher.cancel_ahead(offer.transfer_id)
        return pb.OfferWeightsResponse(offer=offer, rung=rung, ring_seconds=seconds, publishing=publishing)

    def _rung_offer(self, offer: tpb.Offer, ring: list) -> tpb.Offer:
        """A sharded trainer's offer as the replicas it rings get it: naming the holder their ranks keep what they
        pull under (Routing.holder), recorded here so that they let go before the trainer's memory leaves the
        GPU. Replicas prepared otherwise (the coordinator's PrepareUpdate) get the offer without it: what they
        pull they map and close at each update (unless they hold it from the trainer's onload), as nothing
        here could ask them to let go."""
        if not offer.HasField("routing"):
            return offer
        self.holders.routed(ring)
        rung = tpb.Offer()
        rung.CopyFrom(offer)
        rung.routing.holder = self.holders.holder
        offer.routing.ClearField("memories")  # (only a replica that may hold them copies at once)
        return rung

    async def _send_ahead(self, transfer_id: str) -> None:
        await asyncio.sleep(0)  # the rings go out first
        await self.publisher.send_ahead(transfer_id)

    @unary
    async def PublishWeights(self, request: pb.PublishWeightsRequest, context) -> pb.PublishWeightsResponse:
        stamp("asked")
        version, report = await self.publisher.publish(request.transfer_id, list(request.answers), request.timeout)
        return pb.PublishWeightsResponse(version=version, bytes=report.nbytes, seconds=report.seconds,
                                         data_seconds=report.data_seconds, backends=report.backends,
                                         profile=report.profile, wire_bytes=report.wire_bytes,
                                         rank_bytes=report.rank_bytes)

    @unary
    async def GetWeightChecksums(self, request: weights_pb2.GetWeightChecksumsRequest, context):
        return checksums_to_proto(self.step(), await self.publisher.checksums(request.dtype), LIVE)
