"""The hf engine's armed pulls (rlsync.transfer.armed): which storages it holds for whom, the last
pull it made from them, and its bell. A colocated replica's update is then a copy the trainer
starts on the GPU: no thread of this process runs between the offer and the bytes in place.

A replica that generates queues no copy behind a Bell in its GPU memory (a launch that waits for the whole device,
a kernel loaded at its first launch, would wait for the trainer too, and hang the process meanwhile). With
arm_while_generating, its bell lies in host memory (HostBell) and each commit queues the next copy into the
spare weights behind it (`arm_spare`), which the next offer adopts (`adopt_spare`); a step that runs far longer
than usual lets it go (StepWatch: a store of the CPU into the bell). Otherwise it launches that same copy as soon
as a prepare has checked the offer and found it the last pull's (`launch`), before laying out a receiver: the
layout was checked when the pull was learnt, and two calls into the driver that keep the GIL start the copy
(0.26–0.30 ms beside decoding on an H200, the checks included; 0.38–0.44 ms through torch; laying out a receiver
and queueing it, 0.72 ms). A sharded trainer's repeat from storages held here is launched so too, into the
spare store (`launch_routed`) or, colocated, into the woken weights it lands in (`launch_in_place`): the
tables the store keeps (rlsync.transfer.relaunch), of the last armed pull into it or made ahead, at the wake or
as the trainer's onload names new memories (`rearm`). Colocated, those tables are queued at the wake behind the
bell too (`arm_routed`), for the memories the trainer's onload named: its ring starts the copy, as a one-process
trainer's does."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlsync.common import metrics
from rlsync.common.stamps import stamp
from rlsync.flat import FlatStore
from rlsync.rollout.staging import AdoptedUpdate
from rlsync.transfer import batched, driver
from rlsync.transfer.armed import Armed, Bell, key_of, routed_key
from rlsync.transfer.backends.slots import contiguous
from rlsync.transfer.copied import copy_event
from rlsync.transfer.held import HELD
from rlsync.transfer.host_bell import HostBell
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.relaunch import launchable, queue, relaunch
from rlsync.transfer.sharded import RoutedReceiver, known
from rlsync.transfer.streams import resolved, transfer_stream
from rlsync.transfer.v1 import transfer_pb2 as pb


log = logging.getLogger(__name__)


CANCELLED = (1 << 31) - 1  # what the replica writes into its bell to let a copy go: above any value a trainer
# writes (1 to 1 << 30), so that no offer adopts a copy this write started


# How long a prepare waits for the trainer's bell to reach a copy armed beside generation (the watch guards it
# meanwhile), polling every RING_POLL s: the trainer queues its write before it sends the ring, but with the GPU
# shared between the two processes the write may wait for its turn there. One not reached by then is disarmed
# (counted as `late`), and the prepare launches its copy.
RING_WAIT, RING_POLL = 0.02, 0.0002


class StepWatch:
    """The engine's steps and commands, timed (its thread marks each: `began`, `ended`), and a thread that lets
    the copy it guards go (a copy armed beside generation behind a HostBell: `guard`) when a step or command has
    run longer than FACTOR times the usual step and at least `floor` s (arm_patience_ms). It waits for the whole
    device behind the copy (a kernel loaded at its first launch, say), and goes on once the bell is written: here,
    by a store of the CPU."""

    FACTOR = 4.0

    def __init__(self, floor: float = 0.02):
        self.floor = floor
        self.since: float | None = None  # when the step now running began
        self.usual = 0.02  # a moving average of the steps' times (from a guess, until steps are timed)
        self.let_go = 0  # copies let go so far
        self._lock = threading.Lock()
        self._guarded: Armed | None = None
        self._from = 0.0  # when the watch began to guard it
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="rlsync-step-watch", daemon=True).start()

    def began(self) -> None:
        self.since = time.perf_counter()

    def ended(self, step: bool = True) -> None:
        """`step`: a step, whose time joins the usual one (else a command run between steps)."""
        if step and self.since is not None:
            self.usual += 0.1 * (time.perf_counter() - self.since - self.usual)
        self.since = None

    def patience(self) -> float:
        return max(self.floor, self.FACTOR * self.usual)

    def guard(self, armed: Armed) -> None:
        """Guards `armed` from now on (what ran before, the commit that armed it, say, is not held against it)."""
        with self._lock:
            self._guarded, self._from = armed, time.perf_counter()
        self._wake.set()

    def take(self, armed: Armed) -> bool:
        """Stops guarding `armed` -> whether it was still guarded (False: this watch let it go, or never had
        it). Once this returns, the watch writes its bell no more."""
        with self._lock:
            ours = self._guarded is armed
            if ours:
                self._guarded = None
        return ours

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(self.patience() / 2)
            since = self.since
            with self._lock:
                armed = self._guarded
                if armed is None:
                    self._wake.clear()
                    continue
                if since is None or time.perf_counter() - max(since, self._from) <= self.patience():
                    continue
                armed.bell.write(CANCELLED)
                self._guarded = None
                self._wake.clear()
                metrics.REPLICA_ARMED.labels("let_go").inc()
                self.let_go += 1
            log.info("a step ran %.0f ms (usual: %.1f ms): the copy armed beside generation is let go, and the "
                     "next update copies at its prepare", (time.perf_counter() - since) * 1e3, self.usual * 1e3)


async def _reached(bell: Bell, value: int) -> bool:
    """Whether `bell` holds `value`, within RING_WAIT (a bell the CPU cannot read: True; one the watch let go: False
    at once)."""
    until = time.perf_counter() + RING_WAIT
    while (now := bell.holds()) is not None and now != value:
        if now == CANCELLED or time.perf_counter() > until:
            return False
        await asyncio.sleep(RING_POLL)
    return True


class ArmedSpare(NamedTuple):
    """A copy armed beside generation into the spare weights (Arming.arm_spare), and the watch guarding it."""

    armed: Armed
    store: FlatStore
    watch: StepWatch

    def stop(self) -> None:
        """Unguarded, then disarmed: its copy runs out, into the spare, which nothing reads before an update."""
        if self.watch.take(self.armed):  # (else the watch let it go, and counted it)
            metrics.REPLICA_ARMED.labels("stopped").inc()
        self.armed.disarm()


class Arming:
    def __init__(self, device: torch.device, enabled: bool = True, while_generating: bool = False,
                 patience: float = 0.02):
        self.device, self.enabled = resolved(device), enabled  # (its index: one copy event per GPU)
        # (arm_while_generating: a bell in host memory, and the watch that may let its copy go after `patience` s)
        self.watch = StepWatch(patience) if enabled and while_generating else None
        self.bell: Bell | HostBell | None = None
        self.held: tuple[str, tuple[bytes, ...]] | None = None  # the last hold: holder, storages in its order
        self.plan: tuple | None = None  # (specs, mapped locations, the one run they copy) of the last held pull
        self.routed: tuple[pb.Offer, pb.Answer] | None = None  # the last sharded offer copied as prepared, answered
        self.memories: tuple[str, ...] = ()  # its trainer ranks' memories as last named (an onload names new ones)

    def hold(self, holder: str, handles: list[bytes]) -> bytes:
        """Records a hold -> the bell's handle, for the holder to ring."""
        self.held = (holder, tuple(dict.fromkeys(handles)))
        if self.bell is None and self.watch is not None:
            try:
                self.bell = HostBell(self.device)
            except Exception as e:  # noqa: BLE001 - (it only saves time) a bell in GPU memory arms at wakes alone
                log.warning("no bell in host memory (%s): this replica arms no copy while it generates", e)
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
        if self.plan is None or self.held is None or self.bell is None or weights.armed is not None \
                or weights.armed_spare is not None:  # (one copy behind the bell at a time)
            return
        if not weights.pending_restore or weights.store is None:
            return
        weights.armed = self._armed_into(weights.store)

    def _armed_into(self, store: FlatStore) -> Armed | None:
        """The last held pull again, into `store`, queued behind the bell, if the same storages are held and it
        fits the store; else None."""
        specs, region, offset, (index, start, nbytes) = self.plan
        handles = self.held[1]
        src = HELD.get(handles[index]) if index < len(handles) else None
        dst = store.whole_for(specs)
        if src is None or dst is None or dst.numel() != nbytes or src.numel() < start + nbytes:
            return None
        source = src[start:start + nbytes]
        return Armed(self.bell, lambda: dst.copy_(source, non_blocking=True), nbytes,
                     key_of(specs, handles, region, offset))

    def arm_spare(self, weights) -> None:
        """As an update commits, on the engine's thread (arm_while_generating): the last held pull again, into the
        spare weights, behind the bell in host memory, guarded by the watch. The trainer's next bell starts it on
        the GPU, before its ring arrives; the prepare adopts it (`adopt_spare`)."""
        if self.watch is None or self.plan is None or self.held is None or not isinstance(self.bell, HostBell) \
                or weights.armed is not None or weights.armed_spare is not None:
            return
        store = weights.take_spare()
        armed = None
        try:
            armed = self._armed_into(store) if store is not None else None
        except Exception as e:  # noqa: BLE001 - (it only saves time) the next update copies at its prepare
            log.warning("could not arm the next update's copy beside generation: %s", e)
        if armed is None:
            weights.give_back_spare(store)
            return
        self.watch.guard(armed)  # (before anything can take it: the watch lets go only what it guards)
        weights.armed_spare = ArmedSpare(armed, store, self.watch)

    async def adopt_spare(self, weights, specs: list, offer: pb.Offer, version: int):
        """The copy armed into the spare when it is this offer's, not let go by the watch, and started by this
        offer's bell value, which the bell holds (Armed.adopt) -> (the store, its AdoptedUpdate); else None, the copy
        disarmed and the store the spare again. Only a copy the trainer's bell has reached: once adopted, nothing
        lets it go any more, and one not started yet would hold up what waits for the whole device on the engine's
        thread until the trainer's write lands (for good, were the trainer gone)."""
        spare = weights.take_armed_spare()
        if spare is None:
            return None
        armed = spare.armed
        reached = await _reached(armed.bell, offer.mapped.bell)  # (guarded meanwhile)
        guarded = spare.watch.take(armed)  # (from here on the watch writes its bell no more)
        if guarded and reached and armed.adopt(specs, offer):
            metrics.REPLICA_ARMED.labels("adopted").inc()
            return spare.store, AdoptedUpdate(armed.nbytes, armed.bell.event_handle, armed.disarm, version,
                                              reads=armed.reads)
        if guarded:  # (not reached in time; another offer's, or started by an older one)
            metrics.REPLICA_ARMED.labels("stopped" if reached else "late").inc()
        armed.disarm()
        weights.give_back_spare(spare.store)
        return None

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
