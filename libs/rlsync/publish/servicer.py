"""The weight RPCs of TrainerService over a PublisherCore: protobuf <-> domain types, nothing else.

rlsync's trainer service extends this with Train and checkpoints; a user's loop serves it as is
(Train answers FAILED_PRECONDITION: that trainer trains in its own loop).
"""

from __future__ import annotations

import asyncio

import torch

from rlsync.client.weights import ring_hold, ring_prepare, ring_release
from rlsync.common.audit import LIVE, to_proto as checksums_to_proto
from rlsync.common.v1 import weights_pb2
from rlsync.errors import FailedPrecondition
from rlsync.publish.core import PublisherCore
from rlsync.rpc import unary
from rlsync.rpc.doorbell import Lines
from rlsync.trainer.v1 import trainer_pb2 as pb
from rlsync.trainer.v1 import trainer_pb2_grpc
from rlsync.transfer.armed import open_bell
from rlsync.transfer.copied import sender_device
from rlsync.transfer.v1.transfer_pb2 import Doorbell


class PublisherServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, publisher: PublisherCore, describe=None, token: str = "", holder: str = "trainer"):
        self.publisher = publisher
        self.describe = describe  # () -> dict of TrainerState fields beside step and offloaded
        self.token = token  # the fleet's: rung replicas check it as their gRPC servers do
        self.holder = holder  # the name replicas hold this trainer's weights mapped under
        # address -> (doorbell, handles of the storages) of a replica that holds the weights mapped
        self.holding: dict[str, tuple[Doorbell, tuple[bytes, ...]]] = {}
        self.cannot_hold: set[str] = set()  # addresses of replicas that refused to (until the next Offload)
        self.bells: dict[str, torch.Tensor] = {}  # address -> that replica's bell, mapped (rlsync.transfer.armed)
        self.peers: dict[str, str] = {}  # address -> GPU of those that hold them from another GPU (over P2P)
        self.lines = Lines()  # connections to the replicas' doorbells, kept between updates

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
        released = await self.release_held()
        await self.publisher.offload()
        return pb.OffloadResponse(state=self.state(), released=released)

    @unary
    async def Onload(self, request: pb.OnloadRequest, context) -> pb.OnloadResponse:
        regions = await self.publisher.onload(describe=len(request.ring) > 0)
        if regions is not None:  # replicas on this GPU map the weights while training runs
            self._held(regions, await ring_hold(self.holder, *regions, list(request.ring), self.token, self.lines))
            await self._peers_on_one_gpu()
            if self.publisher.offloaded:  # an Offload ran while they mapped: they let go now
                await self.release_held()
        return pb.OnloadResponse(state=self.state(), held=len(self.holding))

    async def _hold(self, regions: tuple, ring: list[Doorbell]) -> None:
        """Replicas on this GPU keep the weights mapped from one update to the next, in every mode (they
        stay where they are until an Offload, which has them let go first): each is asked once per set
        of storages, and one that cannot hold (another GPU, another engine) is not asked again."""
        handles = tuple(regions[0].ipc)
        todo = [d for d in ring if d.address not in self.cannot_hold
                and self.holding.get(d.address, (None, ()))[1] != handles]
        if not todo:
            return
        held = self._held(regions, await ring_hold(self.holder, *regions, todo, self.token, self.lines))
        self.cannot_hold.update(d.address for d in todo if d.address not in held)
        await self._peers_on_one_gpu()

    def _held(self, regions: tuple, held: list) -> set[str]:
        """Records the replicas that hold the storages of `regions` (ring_hold's answers), and maps the
        bell each rings its armed copies by. -> their addresses."""
        device = torch.device("cuda", sender_device(regions[0]))
        for d, response in held:
            self.holding[d.address] = d, tuple(regions[0].ipc)
            if response.peer_gpu:
                self.peers[d.address] = response.peer_gpu
            else:
                self.peers.pop(d.address, None)
            if response.bell:
                self.bells[d.address] = open_bell(response.bell, device)
        return {d.address for d, _ in held}

    async def _peers_on_one_gpu(self) -> None:
        """Replicas on other GPUs read this one's memory over its links all at once, where a broadcast gives
        each the whole link: those on one GPU may hold the weights and pull them (Offer.peer_readers; NCCL
        takes no two of them anyway), those on several let go and take the broadcast."""
        if len(set(self.peers.values())) < 2:
            return
        doorbells = [self.holding.pop(a)[0] for a in sorted(self.peers)]
        self.cannot_hold.update(self.peers)
        self.peers = {}
        await ring_release(self.holder, doorbells, self.token, self.lines)

    def _peer_readers(self, regions: tuple | None) -> list[str]:
        """The replicas (their ids) that pull the offer of `regions` from another GPU: those that hold them."""
        if regions is None:
            return []
        handles = tuple(regions[0].ipc)
        return [d.name for a in self.peers for d, held in [self.holding[a]] if held == handles]

    async def release_held(self) -> int:
        """Has every replica that holds the weights mapped let go (before they leave the GPU, and when the
        trainer leaves: a replica that maps a process's memory keeps it on the GPU after that process ends)."""
        holding = [d for d, _ in self.holding.values()]
        self.holding, self.bells, self.cannot_hold, self.peers = {}, {}, set(), {}
        return await ring_release(self.holder, holding, self.token, self.lines) if holding else 0

    @unary
    async def OfferWeights(self, request: pb.OfferWeightsRequest, context) -> pb.OfferWeightsResponse:
        ring = list(request.ring)
        offer, regions = await self.publisher.offer(request.version if request.HasField("version") else self.step(),
                                                    request.pull, describe=request.hold and bool(ring))
        publishing = False
        try:
            if regions is not None:
                await self._hold(regions, ring)
                if self.publisher.offloaded:  # an Offload ran while they mapped: they let go now
                    await self.release_held()
            del offer.peer_readers[:]
            offer.peer_readers.extend(self._peer_readers(regions))
            rang = asyncio.ensure_future(ring_prepare(offer, ring, self.token, request.force_backend,
                                                      request.timeout, self.lines, self.bells))
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
            publishing = request.publish and all(r.rung for r in rung) and bool(pushed)
            if publishing:  # every replica prepared here: send now, rather than at PublishWeights
                self.publisher.publish_now(offer.transfer_id, pushed, request.timeout)
        finally:
            if not publishing:
                self.publisher.cancel_ahead(offer.transfer_id)
        return pb.OfferWeightsResponse(offer=offer, rung=rung, ring_seconds=seconds, publishing=publishing)

    async def _send_ahead(self, transfer_id: str) -> None:
        await asyncio.sleep(0)  # the rings go out first
        await self.publisher.send_ahead(transfer_id)

    @unary
    async def PublishWeights(self, request: pb.PublishWeightsRequest, context) -> pb.PublishWeightsResponse:
        version, report = await self.publisher.publish(request.transfer_id, list(request.answers), request.timeout)
        return pb.PublishWeightsResponse(version=version, bytes=report.nbytes, seconds=report.seconds,
                                         data_seconds=report.data_seconds, backends=report.backends,
                                         profile=report.profile, wire_bytes=report.wire_bytes,
                                         rank_bytes=report.rank_bytes)

    @unary
    async def GetWeightChecksums(self, request: weights_pb2.GetWeightChecksumsRequest, context):
        return checksums_to_proto(self.step(), await self.publisher.checksums(request.dtype), LIVE)
