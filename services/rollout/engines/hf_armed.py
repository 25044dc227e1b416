"""The hf engine's armed pulls (rlsync.transfer.armed): which storages it holds for whom, the last
pull it made from them, and its bell. A colocated replica's update is then a copy the trainer
starts on the GPU: no thread of this process runs between the offer and the bytes in place.

A replica that generates cannot queue a copy behind a bell (a decode kernel queued after it would
wait for the trainer too), so it launches that same copy as soon as a prepare has checked the offer
and found it the last pull's (`launch`), before laying out a receiver: the layout was checked when
the pull was learnt, and two calls into the driver that keep the GIL start the copy (0.26–0.30 ms
beside decoding on an H200, the checks included; 0.38–0.44 ms through torch; laying out a receiver
and queueing it, 0.72 ms). A sharded trainer's repeat from storages held here is launched so too, into the
spare store (`launch_routed`) or, colocated, into the woken weights it lands in (`launch_in_place`): the
tables the store keeps (rlsync.transfer.relaunch), of the last armed pull into it or made ahead, at the wake or
as the trainer's onload names new memories (`rearm`). Colocated, those tables are queued at the wake behind the
bell too (`arm_routed`), for the memories the trainer's onload named: its ring starts the copy, as a one-process
trainer's does."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from rlsync.common.stamps import stamp
from rlsync.flat import FlatStore
from rlsync.rollout.staging import AdoptedUpdate
from rlsync.transfer import batched, driver
from rlsync.transfer.armed import Armed, Bell, key_of, routed_key
from rlsync.transfer.backends.slots import contiguous
from rlsync.transfer.copied import copy_event
from rlsync.transfer.held import HELD
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.relaunch import launchable, queue, relaunch
from rlsync.transfer.sharded import RoutedReceiver, known
from rlsync.transfer.streams import resolved, transfer_stream
from rlsync.transfer.v1 import transfer_pb2 as pb


log = logging.getLogger(__name__)


class Arming:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled = resolved(device), enabled  # (its index: one copy event per GPU)
        self.bell: Bell | None = None
        self.held: tuple[str, tuple[bytes, ...]] | None = None  # the last hold: holder, storages in its order
        self.plan: tuple | None = None  # (specs, mapped locations, the one run they copy) of the last held pull
        self.routed: tuple[pb.Offer, pb.Answer] | None = None  # the last sharded offer copied as prepared, answered
        self.memories: tuple[str, ...] = ()  # its trainer ranks' memories as last named (an onload names new ones)

    def hold(self, holder: str, handles: list[bytes]) -> bytes:
        """Records a hold -> the bell's handle, for the holder to ring."""
        self.held = (holder, tuple(dict.fromkeys(handles)))
        if self.bell is None:
            self.bell = Bell(self.device)
        return self.bell.handle

    def release(self, holder: str) -> None:
        if self.held is not None and self.held[0] == holder:
            self.held = None

    def learn(self, specs: list, mapped: pb.MappedTensors) -> None:
        """Remembers a pull from held storages that its sender waited for on the GPU (a ring), to
        queue it again at the next wake, or launch it at the next prepare (`launch`). One run of one
        storage into the whole store, or nothing; and nothing for a manifest with checksums (they
        change with every version, and must be checked), nor for a pull that casts
        (MappedTensors.dtype: not a copy of bytes)."""
        run = None if not self.enabled or mapped.dtype or any(s.checksum for s in specs) else \
            contiguous(specs, list(zip(mapped.region, mapped.offset)))
        self.plan = (specs, tuple(mapped.region), tuple(mapped.offset), run) if run is not None else None

    def arm(self, weights) -> None:
        """At a wake of the weights that an update will land in (the backup holds the served ones):
        queues the last held pull again, if the same storages are held and it fits the store."""
        if self.plan is None or self.held is None or self.bell is None or weights.armed is not None:
            return
        if not weights.pending_restore or weights.store is None:
            return
        specs, region, offset, (index, start, nbytes) = self.plan
        handles = self.held[1]
        src = HELD.get(handles[index]) if index < len(handles) else None
        dst = weights.store.whole_for(specs)
        if src is None or dst is None or dst.numel() != nbytes or src.numel() < start + nbytes:
            return
        source = src[start:start + nbytes]
        weights.armed = Armed(self.bell, lambda: dst.copy_(source, non_blocking=True), nbytes,
                              key_of(specs, handles, region, offset))

    def adopt(self, weights, specs: list, offer: pb.Offer, version: int) -> AdoptedUpdate | None:
        """The armed copy, when it is this offer's (rung with a bell value: Armed.adopt); else None."""
        armed = weights.armed
        # (a sharded trainer's copy is armed as the wake's rearm ends, which nothing waits for: one its bell has not
        # started by the time its prepare comes may have been armed after the trainer wrote the bell, and is started
        # here: the ranks' weights were final before the trainer rang)
        if armed is None or not armed.adopt(specs, offer, start=bool(offer.routing.memories)):
            return None  # (a cast: its dtypes differ)
        return AdoptedUpdate(armed.nbytes, armed.bell.event_handle, armed.disarm, version, reads=armed.reads)

    def launch(self, weights, specs: list, mapped: pb.MappedTensors, version: int):
        """Between two decode steps or beside them: the last held pull again, into the spare store, when
        this offer is that pull's (the same tensors from the same places of storages one holder holds,
        as they were listed) and its sender waits for the copy on the GPU (a ring) -> (the store, its
        AdoptedUpdate), else None (the caller lays out a receiver)."""
        if self.plan is None or not mapped.waits or mapped.dtype:
            return None
        plan_specs, region, offset, (index, start, nbytes) = self.plan
        if not (specs == plan_specs and tuple(mapped.region) == region and tuple(mapped.offset) == offset):
            return None
        held = HELD.lookup(list(mapped.ipc))
        if held is None or index >= len(held[0]) or held[0][index].numel() < start + nbytes:
            return None
        mappings, memo = held
        staging = weights.take_spare()  # (taken at once: the engine's thread may drop it for generation)
        dst = staging.whole_for(specs) if staging is not None else None
        if dst is None or dst.numel() != nbytes:
            weights.give_back_spare(staging)
            return None
        cut = memo.get("launch")  # the source's bytes, cut once for as long as the holder's mappings stay
        if cut is None or cut[0] != (index, start, nbytes):
            cut = memo["launch"] = (index, start, nbytes), mappings[index][start:start + nbytes]

        def queue(stream: torch.cuda.Stream) -> tuple[int, None]:
            # Two calls into the driver holding the GIL (rlsync.transfer.driver, the copy and its event): through
            # torch each lets go of it and waits to take it back from the decode loop.
            driver.copy(dst, cut[1], stream)
            return nbytes, None  # (what it reads stays open in the holder's memo)
        return self._into_spare(weights, staging, version, queue)

    def launch_routed(self, weights, specs: list, routing: pb.Routing, version: int):
        """As `launch`, for a sharded trainer's offer naming its ranks' memories (Routing.memories): the launch the
        spare store keeps (rlsync.transfer.relaunch: of the last armed routed pull into it, or made ahead by
        `rearm`), again, when this offer names the same memories -> (the store, its AdoptedUpdate), else None."""
        if not self.enabled or not routing.memories or not routing.holder:
            return None
        staging = weights.take_spare()
        if staging is None:
            return None
        return self._into_spare(weights, staging, version, lambda stream: _relaunch(staging, specs, routing, stream))

    def launch_in_place(self, weights, specs: list, routing: pb.Routing, version: int) -> AdoptedUpdate | None:
        """As `launch_routed`, into woken weights that no refill will touch meanwhile (the caller receives in
        place): what they kept since `rearm`, else None."""
        store = weights.store
        if not self.enabled or store is None or not routing.memories or not routing.holder:
            return None
        return self._queued(version, lambda stream: _relaunch(store, specs, routing, stream))

    def arm_routed(self, weights) -> None:
        """At a wake of the weights a sharded trainer's update will land in, once the launch of its copy is made in
        them (`rearm`): queues that launch behind the bell, for the trainer to start as it rings the offer (its
        ranks' weights are final once they described their memories: ShardedSender.describe). The prepare adopts
        it when the offer names the same memories (`adopt`); else it is disarmed, and the backup refills."""
        if not self.enabled or self.bell is None or self.held is None or self.routed is None \
                or weights.armed is not None or not weights.pending_restore or weights.receiving_in_place \
                or weights.store is None:
            return  # (an update receiving into them already: an onload's read-ahead may come meanwhile)
        offer, store = self._next_routed(), weights.store
        specs = from_proto(offer.manifest)
        found = launchable(store.memo, offer.routing, specs)
        if found is None or not all(batched.loaded(t) for t in found[0].tables):
            return
        try:
            weights.armed = Armed(self.bell, lambda: queue(found), found[0].nbytes, routed_key(specs, offer.routing))
        except Exception as e:  # noqa: BLE001 - (it only saves time) the offer launches its copy as before
            log.warning("could not arm a sharded trainer's next copy: %s", e)

    def _next_routed(self) -> pb.Offer:
        """The last sharded offer copied as prepared, naming the memories the next one will (`memories`)."""
        offer = pb.Offer()
        offer.CopyFrom(self.routed[0])
        del offer.routing.memories[:]
        offer.routing.memories.extend(self.memories)
        return offer

    def learn_routed(self, offer: pb.Offer, answer: pb.Answer) -> None:
        """A sharded trainer's offer this replica copied as it prepared (armed), and its answer: what the next
        ones will be like, for `rearm`."""
        self.routed, self.memories = (offer, answer), tuple(offer.routing.memories)

    def rearm(self, store: FlatStore | None, memories: Sequence[str] = ()) -> bool:
        """Before a sharded trainer's next offer: makes in `store` (weights woken for it, or the spare) the launch
        its copy will be (RoutedReceiver.keep_ahead), for the last armed offer naming `memories` (the trainer's
        onload names new ones; by default those it named last) -> whether it did. Only saves time: a failure is
        logged, and the offer arms as before."""
        if memories:
            self.memories = tuple(memories)
        if not self.enabled or self.routed is None or store is None or not known(self.memories):
            return False  # (nothing read here: on the engine's thread, arming reads only what is known)
        offer, ans = self._next_routed(), pb.Answer()
        ans.CopyFrom(self.routed[1])
        try:
            return RoutedReceiver(offer, ans, store, device=self.device, hold=offer.routing.holder,
                                  at_once=True).keep_ahead()
        except Exception as e:  # noqa: BLE001 - the offer arms as it would have
            log.warning("could not make a sharded trainer's next copy ahead of its offer: %s", e)
            return False

    def _into_spare(self, weights, staging, version: int, queue):
        """_queued into the spare store `staging` -> (the store, its AdoptedUpdate), else None (the store goes
        back). No event handed over (the spare has been idle since the commit that retired it, after a
        synchronize) and no wait of the engine's stream for the copy: nothing reads the store before the commit,
        which synchronizes the device, and an abort waits for the copy before it lets the store go."""
        try:
            update = self._queued(version, queue)
        except BaseException:
            weights.give_back_spare(staging)
            raise
        if update is None:
            weights.give_back_spare(staging)
            return None
        return staging, update

    def _queued(self, version: int, queue) -> AdoptedUpdate | None:
        """`queue(stream)` queues a copy on the transfer stream -> (its bytes, what it reads), or None when it
        queued nothing; then the copy's event -> its AdoptedUpdate, else None."""
        stream = transfer_stream(self.device)
        try:
            queued = queue(stream)
            if queued is None:
                return None
            stamp("launched")
            event, copied = copy_event(self.device)
            driver.record(event, stream)
        except BaseException:
            stream.synchronize()  # whatever was queued ends before its store goes
            raise
        return AdoptedUpdate(queued[0], copied, stream.synchronize, version, reads=queued[1])


def _relaunch(store: FlatStore, specs: list, routing: pb.Routing, stream: torch.cuda.Stream):
    with torch.cuda.stream(stream):
        return relaunch(store.memo, routing, specs)
