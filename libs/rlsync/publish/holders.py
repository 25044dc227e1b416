"""The replicas that keep a trainer's weights mapped between updates (HoldWeights), and those of them that pull
the weights from another GPU.

A replica on the trainer's GPU holds them from its first offer (or onload) until the trainer offloads, so an
update neither maps nor closes anything. A replica on another GPU of the host that reads the trainer's by P2P
may hold them too (it answers with its GPU: HoldWeightsResponse.peer_gpu) and then pulls them, named in the
offer (Offer.peer_readers), where the trainer publishes while it trains on (not a colocated pull, where the
weights are mapped anew at each onload). Readers on several GPUs would share the trainer GPU's links, where a
broadcast gives each the whole link: the largest group on one GPU keeps holding, the others let go and take the
broadcast (NCCL takes no two members on one GPU: a group of readers there is better off pulling).
A sharded trainer's rank 0 names every rank's storages on its GPU at an onload (gathered from the ranks, in
rank order: what a receiver rank's pull holds), and the replicas it rings with an offer keep what their ranks
pull mapped, under the holder the rung offer names (Routing.holder), and are recorded here (`routed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import torch

from rlsync.client.weights import ring_hold, ring_release
from rlsync.rpc.doorbell import Lines
from rlsync.transfer.armed import open_bell
from rlsync.transfer.copied import sender_device
from rlsync.transfer.v1.transfer_pb2 import Doorbell, Routing


log = logging.getLogger(__name__)

ROUTED_HOLD = (b"routed",)  # what a replica holds of a sharded trainer: what each of its ranks pulled (no list here)


class Holders:
    def __init__(self, holder: str, token: str, lines: Lines):
        self.holder, self.token, self.lines = holder, token, lines  # the name replicas hold the weights under
        # address -> (doorbell, handles of the storages) of a replica that holds the weights mapped
        self.holding: dict[str, tuple[Doorbell, tuple[bytes, ...]]] = {}
        self.cannot_hold: set[str] = set()  # addresses of replicas that refused to, or let go (until the next release)
        self.bells: dict[str, torch.Tensor] = {}  # address -> that replica's bell, mapped (rlsync.transfer.armed)
        # address -> the sharded trainer's memories (Routing.memories) a replica was asked to hold at the onload
        self.memories: dict[str, tuple[str, ...]] = {}
        self.peer_gpus: dict[str, str] = {}  # address -> GPU of a replica found on another GPU (kept for good)
        self._letting_go: set[asyncio.Task] = set()

    async def hold(self, regions: tuple, ring: list[Doorbell], peers: bool, routing: Routing | None = None) -> None:
        """Asks the replicas of `ring` that do not hold the storages of `regions` (MappedTensors, Facts) to hold
        them, once per set of storages; one that cannot (another host, another engine) is not asked again.
        peers: replicas on other GPUs may hold them and pull; else those known to be on one are not asked,
        and those found to be let go at once. Holders no longer in `ring` (gone, or out of the rotation) are
        forgotten, and asked to let go in the background. routing: a sharded trainer's (HoldWeightsRequest's)."""
        rung = {d.address for d in ring}
        self._forget([address for address in self.holding if address not in rung])
        handles = tuple(regions[0].ipc)
        todo = [d for d in ring if d.address not in self.cannot_hold and (peers or d.address not in self.peer_gpus)
                and self.holding.get(d.address, (None, ()))[1] != handles]
        if todo:
            held = self._record(regions, await ring_hold(self.holder, *regions, todo, self.token, self.lines,
                                                         routing=routing))
            if routing is not None and routing.memories:
                self.memories.update((address, tuple(routing.memories)) for address in held)
            self.cannot_hold.update(d.address for d in todo if d.address not in held)
        await self._settle_peers(peers)

    def routed(self, ring: list[Doorbell]) -> None:
        """Records the replicas of `ring` as holding what their ranks pull of a sharded trainer's memory (the
        offer they are rung with names the holder: Routing.holder), so that they let go at the next release;
        holders no longer in `ring` are forgotten, and asked to let go in the background, as in hold()."""
        rung = {d.address for d in ring}
        self._forget([address for address in self.holding if address not in rung])
        for d in ring:
            self.holding[d.address] = d, ROUTED_HOLD

    def _record(self, regions: tuple, held: list) -> set[str]:
        """Records the replicas that hold the storages of `regions` (ring_hold's answers), and maps the bell each
        rings its armed copies by. -> their addresses."""
        device = torch.device("cuda", sender_device(regions[0]))
        for d, response in held:
            self.holding[d.address] = d, tuple(regions[0].ipc)
            self.bells.pop(d.address, None)
            self.memories.pop(d.address, None)
            if response.peer_gpu:
                self.peer_gpus[d.address] = response.peer_gpu
            else:
                self.peer_gpus.pop(d.address, None)
            if response.bell:
                try:
                    self.bells[d.address] = open_bell(response.bell, device)
                except Exception as e:  # noqa: BLE001 - (Unmappable, or the driver's refusal) its offers then
                    # start their copy as they prepare
                    log.warning("%s: no armed copy of %s's is started by its bell: %s", self.holder, d.name, e)
        return {d.address for d, _ in held}

    async def _settle_peers(self, peers: bool) -> None:
        by_gpu: dict[str, list[str]] = defaultdict(list)
        for address in self.holding:
            if address in self.peer_gpus:
                by_gpu[self.peer_gpus[address]].append(address)
        keep = max(by_gpu.values(), key=len) if peers and by_gpu else []
        go = [address for group in by_gpu.values() if group is not keep for address in group]
        if go:
            doorbells = [self.holding.pop(address)[0] for address in go]
            if peers:  # (not peers: they are not asked while they are known to be on another GPU)
                self.cannot_hold.update(go)
            await ring_release(self.holder, doorbells, self.token, self.lines)

    def _forget(self, addresses: list[str]) -> None:
        if not addresses:
            return
        doorbells = [self.holding.pop(address)[0] for address in addresses]
        for address in addresses:
            self.bells.pop(address, None)
            self.memories.pop(address, None)
        task = asyncio.ensure_future(ring_release(self.holder, doorbells, self.token, self.lines))
        self._letting_go.add(task)  # (the loop keeps only a weak reference to a task)
        task.add_done_callback(self._letting_go.discard)

    def bells_for(self, offer) -> dict[str, torch.Tensor]:
        """The bells to write for `offer`, by doorbell address: of the replicas that hold exactly the storages it
        maps (a sharded trainer's offer: exactly the ranks' memories it names, held since the onload), and none for
        an adapter. A copy armed at a wake repeats a pull of the weights from those storages; rung for any other
        offer, it would run for nothing into weights that may have no backup to refill them."""
        if offer.manifest.HasField("adapter"):
            return {}
        if offer.routing.memories:
            memories = tuple(offer.routing.memories)
            return {a: b for a, b in self.bells.items() if self.memories.get(a) == memories}
        handles = tuple(offer.mapped.ipc)
        return {a: b for a, b in self.bells.items() if self.holding.get(a, (None, ()))[1] == handles}

    def peer_readers(self, regions: tuple | None) -> list[str]:
        """The replicas (their ids) that pull the offer of `regions` from another GPU: those that hold them."""
        if regions is None:
            return []
        handles = tuple(regions[0].ipc)
        return [d.name for address, (d, held) in self.holding.items() if address in self.peer_gpus and held == handles]

    async def release(self) -> int:
        """Has every replica that holds the weights let go -> how many answered."""
        holding = [d for d, _ in self.holding.values()]
        self.holding, self.bells, self.memories, self.cannot_hold = {}, {}, {}, set()
        return await ring_release(self.holder, holding, self.token, self.lines) if holding else 0
