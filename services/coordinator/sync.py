"""The weight-sync sequences. Each is one short, numbered function: read it top to bottom to know
exactly what happens to every replica and the trainer, in which order.

A member the registry loses (its lease ran out: dead, or hung and silent) has every call to it
abandoned at once (Member.gone): a step every replica takes on its own goes on without it, and a
transfer it was part of fails and is run again with the survivors, in the same SyncWeights call."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from rlsync.client import (Gone, RpcError, abort_staged_async, commit_staged_async, push_weights_async,
                           stage_weights_async)
from rlsync.common import metrics
from rlsync.common.aio import settle
from rlsync.common.audit import differences, trainer_dtype
from rlsync.common.timing import Stopwatch
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.registry import Member, Registry
from rlsync.errors import FailedPrecondition, Unavailable
from rlsync.quant.fp8_format import describe
from rlsync.rollout.v1 import rollout_pb2
from rlsync.transfer.v1 import transfer_pb2

log = logging.getLogger(__name__)
# A transfer's deadline, once a sync has measured the rate: MARGIN times what the largest update seen
# takes at that rate, never below FLOOR seconds (a new group's setup, a busy host) nor above
# --update-timeout, which alone bounds the first sync.
DEADLINE_FLOOR, DEADLINE_MARGIN = 30.0, 10.0


@dataclass
class SyncResult:
    version: int
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    replicas: int = 0
    bytes: int = 0
    backends: dict[str, int] = field(default_factory=dict)
    verified: bool = False
    transfer_profile: dict[str, float] = field(default_factory=dict)
    wire_bytes: int = 0
    trainer_rank_bytes: list[int] = field(default_factory=list)


class Syncer:
    def __init__(self, registry: Registry, cfg: CoordinatorConfig):
        self.registry, self.cfg = registry, cfg
        self.version = 0  # what the fleet serves
        self.trainer_step = 0
        self.syncs = 0
        self.lock = asyncio.Lock()  # one sync, train or catch-up at a time
        self.ready = asyncio.Event()  # set while replicas may take generation requests
        self.ready.set()
        self._rate = 0.0  # bytes per second the last sync moved (prepare + transfer)
        self._largest = 0  # the largest update's bytes so far
        metrics.FLEET_VERSION.set_function(lambda: self.version)
        metrics.TRAINER_STEP.set_function(lambda: self.trainer_step)
        metrics.REPLICAS.labels("ready").set_function(lambda: len(registry.rollouts("ready")))
        metrics.REPLICAS.labels("all").set_function(lambda: len(registry.rollouts(None)))
        metrics.REPLICAS.labels("suspect").set_function(lambda: sum(bool(r.suspect) for r in registry.rollouts(None)))

    def _trainer(self) -> Member:
        trainer = self.registry.trainer()
        if trainer is None:
            raise FailedPrecondition("no trainer is registered: start one with --coordinator, or give the "
                                     "coordinator --trainer")
        return trainer

    def _replicas(self) -> list[Member]:
        replicas = self.registry.rollouts("ready")
        if not replicas:
            raise FailedPrecondition("no rollout replica is ready")
        return replicas

    # ---- colocated: trainer and engines share the GPUs -------------------------------------------
    async def before_train(self) -> dict[str, float]:
        """Colocated, before each training step: engines release the GPU, the trainer takes it."""
        async with self.lock:
            trainer, replicas, p = self._trainer(), self._replicas(), Stopwatch()
            self.ready.clear()  # the gateway holds new requests until the next sync wakes the engines
            # 1. Put the engines to sleep (requests in flight are aborted; the gateway resubmits them).
            await self._each(replicas, lambda r: r.client.sleep(level=1))
            p.lap("sleep")
            # 2. Bring the trainer back onto the GPU; replicas on it map its weights while it trains.
            holders = [d for r, d in zip(replicas, self._doorbells(replicas))
                       if d is not None and r.state != "gone"] if self.cfg.hold_weights else []
            await trainer.client.onload(ring=holders)
            p.lap("onload")
            return p.stages

    async def _colocated(self, trainer: Member, replicas: list[Member], version: int | None, backend: str,
                         verify: bool) -> tuple:
        p = Stopwatch()
        # 1. Wake the engines' weights: memory to receive the update into.
        await self._each(replicas, lambda r: r.client.wake_up("weights"))
        p.lap("wake_weights")
        # 2. Handshake + transfer (CUDA IPC / shm), 3. commit on every engine.
        # Nothing trains until the next before_train (this lock is held): replicas on the trainer's GPU
        # may pull the weights straight from its memory while they prepare.
        push = await push_weights_async(trainer.client, [r.client for r in replicas], version, backend,
                                        self._deadline(), pull=True, doorbells=self._doorbells(replicas),
                                        hold=self.cfg.hold_weights, fmt=weight_format(replicas))
        p.add(push.phases)
        verified = await self._verify(trainer, replicas) if verify else False  # while the trainer is on the GPU
        p.lap("verify")
        # 4. Offload the trainer: its GPU memory goes to the engines' KV cache.
        await trainer.client.offload()
        p.lap("offload")
        # 5. Wake the KV cache: generation can start on the new weights.
        await self._each(replicas, lambda r: r.client.wake_up("kv_cache"))
        p.lap("wake_kv_cache")
        self.ready.set()
        return push, p.stages, verified

    # ---- async: separate GPUs or hosts ---------------------------------------------------------------
    async def _async(self, trainer: Member, replicas: list[Member], version: int | None, backend: str,
                     verify: bool) -> tuple:
        p, clients = Stopwatch(), [r.client for r in replicas]
        # 1. Handshake + broadcast (NCCL / gloo / shm) into every replica's staging, while it serves N.
        push = await stage_weights_async(trainer.client, clients, version, backend, self._deadline(),
                                         doorbells=self._doorbells(replicas), hold=self.cfg.hold_weights,
                                         fmt=weight_format(replicas))
        p.add(push.phases)
        # 2. Pause every replica, aborting requests in flight; returns once none still runs on the old
        #    weights (an acknowledged barrier). The gateway resubmits the aborted requests after step 4.
        self.ready.clear()
        try:
            await self._each(replicas, lambda r: r.client.pause("abort"))  # all settle: no resume overtakes one
            p.lap("pause")
            # 3. Commit everywhere: the staged weights go live (a pointer swap, or vLLM's reload).
            await commit_staged_async(clients, push, self._deadline())
            p.add({k: v for k, v in push.phases.items() if k.startswith("commit")})
        except BaseException:
            await abort_staged_async(clients)  # (a no-op where the commit went through)
            raise
        finally:
            # 4. Resume: new tokens carry the new version.
            await asyncio.gather(*(r.client.resume() for r in replicas), return_exceptions=True)
            p.lap("resume")
            self.ready.set()
        verified = await self._verify(trainer, replicas) if verify else False  # after the pause window
        p.lap("verify")
        return push, p.stages, verified

    # ---- inflight: separate GPUs or hosts, and generation never stops -------------------------------
    async def _inflight(self, trainer: Member, replicas: list[Member], version: int | None, backend: str,
                        verify: bool) -> tuple:
        p = Stopwatch()
        # 1. Handshake + transfer into every replica's staging memory while it keeps generating on N.
        # 2. Commit: each replica switches between two engine steps. Requests in flight are not
        #    aborted: their tokens so far carry N, the next ones N+1 (optionally on a KV cache
        #    recomputed with N+1). Every replica switches at its own next step boundary.
        push = await push_weights_async(trainer.client, [r.client for r in replicas], version, backend,
                                        self._deadline(), recompute_kv=self.cfg.recompute_kv,
                                        doorbells=self._doorbells(replicas), hold=self.cfg.hold_weights,
                                        fmt=weight_format(replicas))
        p.add(push.phases)
        verified = await self._verify(trainer, replicas) if verify else False
        p.lap("verify")
        return push, p.stages, verified

    async def sync(self, version: int | None = None, backend: str = "", verify: bool = False) -> SyncResult:
        async with self.lock:
            start = time.perf_counter()
            trainer, replicas = self._trainer(), self._replicas()
            sequence = {"colocated": self._colocated, "async": self._async, "inflight": self._inflight}[
                self.cfg.sync_mode]
            backend = backend or self.cfg.force_backend
            while True:
                try:
                    push, phases, verified = await sequence(trainer, replicas, version, backend, verify)
                    break
                except Exception as e:
                    if trainer.state == "gone":  # lost mid-sync: its calls were abandoned (Member.gone)
                        raise Unavailable(f"{trainer.left}: the sync is abandoned; the replicas keep the "
                                          f"weights they serve (fleet version {self.version}) and drop what was "
                                          "staged; sync again once a trainer has registered") from e
                    # A replica that died or hung mid-update (a broadcast fails for every receiver; calls
                    # to a hung one are abandoned when its lease runs out) leaves the rotation now, and
                    # the survivors get the update at once, without it.
                    survivors = await self._survivors(replicas)
                    if not survivors or len(survivors) == len(replicas):
                        raise
                    log.warning("sync failed with %d replica(s) gone; again with the %d alive",
                                len(replicas) - len(survivors), len(survivors), exc_info=True)
                    replicas = survivors
                    if self.cfg.sync_mode == "colocated":  # a failure after step 4 left it offloaded
                        await self._onloaded(trainer)
            verify_seconds = phases.pop("verify")  # an audit, not part of the sync itself
            self.version = push.version
            self.trainer_step = max(self.trainer_step, push.version)  # a trainer with its own loop never calls Train
            trainer.weight_version = push.version  # what it last published
            for r, channel in zip(replicas, push.channels):
                r.weight_version, r.backend = push.version, channel
            self.syncs += 1
            self._measure(push)
            seconds = time.perf_counter() - start - verify_seconds
            _record(self.cfg.sync_mode, seconds, phases, push)
            serving = sum(r.state != "gone" for r in replicas)  # one lost after its commit is not counted
            return SyncResult(push.version, phases, seconds, serving, push.bytes, push.backends, verified,
                              push.profile, push.wire_bytes, push.rank_bytes)

    def _deadline(self) -> float:
        """Seconds the next transfer may take (DEADLINE_FLOOR, DEADLINE_MARGIN)."""
        if not self._rate:
            return self.cfg.update_timeout
        return min(self.cfg.update_timeout, max(DEADLINE_FLOOR, DEADLINE_MARGIN * self._largest / self._rate))

    def _measure(self, push) -> None:
        moving = push.phases.get("prepare", 0.0) + push.phases.get("transfer", 0.0)  # offer in hand -> bytes in place
        if push.bytes and moving > 0:
            self._rate, self._largest = push.bytes / moving, max(self._largest, push.bytes)

    async def _each(self, replicas: list[Member], call) -> None:
        """call(r) on every replica at once, all settled; a replica that leaves the fleet meanwhile is
        left out (its call abandoned: Gone), any other failure is raised."""
        async def one(r: Member) -> None:
            try:
                await call(r)
            except Gone:
                pass

        await settle(*(one(r) for r in replicas))

    async def _onloaded(self, trainer: Member) -> None:
        if (await trainer.client.state()).offloaded:
            await trainer.client.onload()

    async def _survivors(self, replicas: list[Member]) -> list[Member]:
        """The replicas still alive; the others leave the rotation now rather than at their lease
        (the gateway resumes their requests elsewhere). A replica that does not answer is left to the
        lease, which its call races: a hung one is dropped within it, a busy one answers late."""
        async def alive(r: Member) -> bool:
            if r.state == "gone":  # its lease ran out meanwhile
                return False
            try:
                return (await r.client.info(timeout=3 * self.registry.lease)).state != rollout_pb2.SERVING_STATE_DEAD
            except RpcError as e:  # unreachable (dead, or dropped by the lease: Gone), or too busy to answer yet
                return not e.retryable

        checks = await asyncio.gather(*(alive(r) for r in replicas))
        for r, ok in zip(replicas, checks):
            if ok:
                continue
            if r.static:  # never registers again: it stays a member, out of rotation until caught up
                r.state = "syncing"
                self.registry.spawn(self.catch_up(r))
            else:  # registers again when it is back
                self.registry.lose(r.id, "gone during a sync", "dead")
        return [r for r, ok in zip(replicas, checks) if ok]

    def _doorbells(self, replicas: list[Member]) -> list:
        """Where the trainer may hand each replica the offer itself (those on its host)."""
        return [r.doorbell if self.cfg.doorbell else None for r in replicas]

    async def _verify(self, trainer: Member, replicas: list[Member]) -> bool:
        """Trainer and replica checksums, tensor for tensor (the trainer must be on its device)."""
        for r in replicas:
            try:
                served = await r.client.checksums()
            except Gone:
                continue  # it left the fleet: what it serves is no longer the fleet's
            try:
                problems = differences(await trainer.client.checksums(trainer_dtype(served)), served)
            except Gone as e:  # the update is live already: an audit cannot undo it
                log.error("could not verify the sync: %s", e.message)
                return False
            if problems:
                log.error("replica %s does not serve the trainer's weights: %s", r.name, problems[:3])
                return False
        return True

    # ---- late joiners --------------------------------------------------------------------------------
    async def catch_up(self, member: Member) -> None:
        """Brings a replica that joined late to the trainer's weights before it takes traffic."""
        try:
            await self._catch_up(member)
        except Exception:  # noqa: BLE001 - out of rotation until it registers again, and tries again then
            log.exception("could not bring %s up to date; it leaves the fleet and registers again", member.name)
            if not member.static:  # its next heartbeat is answered "unknown": it registers again
                self.registry.lose(member.id, "could not be caught up", "catch_up_failed")

    async def _catch_up(self, member: Member) -> None:
        async with self.lock:
            if member.state == "gone":
                return
            info = await member.client.info()
            member.doorbell = info.doorbell if info.HasField("doorbell") else None
            member.weight_format = info.weight_format if info.HasField("weight_format") else None
            if not self.syncs and info.weight_version > self.version:
                self._adopt(info.weight_version, member)
            member.weight_version = info.weight_version
            if not await self._take_back(member, info):
                member.state = "ready"  # asleep with the rest in a colocated step: the next sync brings it along
                self.registry.changed.set()
                return
            if info.weight_version != self.version:
                trainer = self.registry.trainer()
                if trainer is None:  # trainer_joined() tries again
                    log.warning("%s serves version %d, the fleet %d, and no trainer is registered: it waits",
                                member.name, info.weight_version, self.version)
                    return
                state = await trainer.client.state()  # colocated: the trainer may be offloaded
                if state.offloaded:
                    await trainer.client.onload()
                # The trainer's weights are the fleet's version unless it has trained since the last sync
                # (then they are its newer step, and say so).
                version = self.version if self.syncs and self.trainer_step == self.version else None
                push = await push_weights_async(trainer.client, [member.client], version, self.cfg.force_backend,
                                                self._deadline(), doorbells=self._doorbells([member]),
                                                fmt=weight_format([member]))
                if state.offloaded:
                    await trainer.client.offload()
                member.weight_version, member.backend = push.version, push.channels[0]
                log.info("%s caught up to version %d", member.name, push.version)
            member.state = "ready"
            self.registry.changed.set()

    def _adopt(self, version: int, member: Member) -> None:
        """A coordinator that has not synced yet (a restarted one) learns the fleet's version from its
        replicas: the newest one any serves. Replicas already taken in at an older one catch up."""
        log.info("%s serves version %d: the fleet's version until the next sync", member.name, version)
        self.version = version
        for other in self.registry.rollouts("ready"):
            if other.weight_version < version:
                other.state = "syncing"
                self.registry.spawn(self.catch_up(other))

    async def _take_back(self, member: Member, info) -> bool:
        """A replica that joins paused, asleep or holding a prepared update was left so by a coordinator
        that is gone (this one holds the lock: no sequence of its own is under way). Its update is
        dropped and it is resumed. Asleep, it is woken while the fleet serves, except in colocated
        mode: the trainer may hold the GPU (a restarted coordinator cannot know), so it stays asleep,
        the gateway holds requests, and the next sync wakes every engine. False: left asleep."""
        if info.pending_version >= 0:
            await member.client.abort_update()
        if info.state != rollout_pb2.SERVING_STATE_SERVING:  # paused (maybe asleep too): Resume is idempotent
            await member.client.resume()
        if info.asleep:
            if self.cfg.sync_mode == "colocated" or not self.ready.is_set():
                self.ready.clear()
                return False
            await member.client.wake_up()
        return True

    async def trainer_joined(self) -> None:
        trainer = self.registry.trainer()
        if not self.syncs and trainer is not None:  # a restarted coordinator learns the trainer's step from it
            try:
                self.trainer_step = (await trainer.client.state()).step
            except Exception:  # noqa: BLE001 - learnt at its next Train instead
                log.warning("could not read the trainer's step", exc_info=True)
        for member in self.registry.rollouts("syncing"):
            self.registry.spawn(self.catch_up(member))


def _record(mode: str, seconds: float, phases: dict[str, float], push) -> None:
    """A completed sync's figures, for Prometheus."""
    metrics.SYNCS.labels(mode).inc()
    metrics.SYNC_SECONDS.labels(mode).observe(seconds)
    for phase, t in phases.items():
        metrics.SYNC_PHASE_SECONDS.labels(mode, phase).observe(t)
    metrics.SYNC_WIRE_BYTES.inc(push.wire_bytes)
    moving = phases.get("prepare", 0.0) + phases.get("transfer", 0.0)  # the offer in hand -> bytes in place
    for backend, ranks in push.backends.items():
        metrics.SYNC_BYTES.labels(backend).inc(push.bytes * ranks)
        if moving > 0:
            metrics.TRANSFER_GBPS.labels(backend).set(push.bytes / moving / 1e9)


def weight_format(replicas: list[Member]):
    """The one format the replicas hold their weights in (None: the trainer's dtype); one update sends one
    format, so a fleet that mixes them is refused, naming them. Fused experts go out stacked where every
    replica takes them so (WeightFormat.stacked_experts), else per expert to all of them."""
    formats = {describe(r.weight_format): r.weight_format for r in replicas}
    if len(formats) > 1:
        raise FailedPrecondition("the replicas hold their weights in different formats ("
                                 + "; ".join(f"{r.name}: {describe(r.weight_format)}" for r in replicas)
                                 + "): one update publishes one format; serve one model per fleet")
    fmt = next(iter(formats.values()), None)
    if fmt is not None and fmt.stacked_experts and not all(
            r.weight_format is not None and r.weight_format.stacked_experts for r in replicas):
        fmt = transfer_pb2.WeightFormat(fp8=fmt.fp8) if fmt.HasField("fp8") else None
    return fmt
