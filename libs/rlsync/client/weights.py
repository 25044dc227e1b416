"""Pushing the trainer's weights into rollout replicas: offer -> prepare on every replica ->
publish -> commit on every replica (a replica on the trainer's GPU pulls the bytes while it
prepares; when all do, there is no publish). The coordinator wraps this in its sync sequences; scripts
and tests can call it directly."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rlsync.client.rollout import AsyncRolloutClient, RolloutClient
from rlsync.client.trainer import AsyncTrainerClient, TrainerClient
from rlsync.common.aio import settle
from rlsync.common.timing import Stopwatch
from rlsync.transfer.v1.transfer_pb2 import Backend


@dataclass
class PushReport:
    version: int
    bytes: int
    backends: dict[str, int]
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    profile: dict[str, float] = field(default_factory=dict)  # the transfer phase broken down
    channels: list[str] = field(default_factory=list)  # the backend each rollout chose, in their order
    wire_bytes: int = 0  # what the trainer sent (deltas: only what changed; pulled replicas copied theirs)


def _pushed(answers: list) -> list:
    """The answers the trainer must send to: the others pulled while they prepared (cuda_ipc)."""
    return [a for a in answers if not a.pull]


def _report(offer, pub, phases: dict[str, float], answers: list) -> PushReport:
    """The profile: each stage of the replicas' prepare (a pull's copy included) at its slowest
    replica, and prepare_rpc, what the prepare phase took beyond the slowest replica's stages;
    then, for a publish, rpc (the transfer phase less the trainer's own send() time) and the
    trainer's and receivers' stages of the send."""
    channels = [Backend.Name(a.backend).removeprefix("BACKEND_").lower() for a in answers]
    profile: dict[str, float] = {}
    backends: dict[str, int] = dict(pub.backends) if pub is not None else {}
    for a, name in zip(answers, channels):
        if a.pull:
            backends[name] = backends.get(name, 0) + a.ranks
        for stage, seconds in a.stages.items():
            profile[f"receiver_{stage}"] = max(profile.get(f"receiver_{stage}", 0.0), seconds)
    slowest = max((sum(a.stages.values()) for a in answers), default=0.0)
    profile["prepare_rpc"] = max(phases["prepare"] - slowest, 0.0)
    if pub is not None:
        profile["rpc"] = max(phases["transfer"] - pub.seconds, 0.0)
        for stage, seconds in pub.profile.items():  # the slowest receiver, pulled or pushed
            profile[stage] = max(profile.get(stage, 0.0), seconds)
    return PushReport(offer.manifest.version, sum(t.nbytes for t in offer.manifest.tensors), backends, phases,
                      profile, channels, pub.wire_bytes if pub is not None else 0)


def stage_weights(trainer: TrainerClient, rollouts: list[RolloutClient], version: int | None = None,
                  force_backend: str = "", timeout: float = 0, pull: bool = False) -> PushReport:
    """Offer -> prepare on every replica -> publish, one call after the other (stage_weights_async
    overlaps the replicas). Every replica then holds the new version in staging; commit it with
    commit_staged (or RolloutClient.abort_update). On failure nothing stays staged.

    pull: replicas on the trainer's GPU copy the weights while they prepare (no publish for them);
    only while nothing trains, offloads or loads until this returns."""
    clock = Stopwatch()
    offer = trainer.offer_weights(version, pull)
    clock.lap("offer")
    try:
        answers = [r.prepare_update(offer, force_backend, timeout).answer for r in rollouts]
        clock.lap("prepare")
        pushed = _pushed(answers)
        pub = trainer.publish_weights(offer.transfer_id, pushed, timeout) if pushed else None
    except Exception:
        for r in rollouts:
            r.abort_update()
        raise
    clock.lap("transfer")
    return _report(offer, pub, clock.stages, answers)


def commit_staged(rollouts: list[RolloutClient], push: PushReport, timeout: float = 0,
                  recompute_kv: bool = False) -> None:
    clock = Stopwatch()
    for r in rollouts:
        r.commit_update(push.version, timeout=timeout, recompute_kv=recompute_kv)
    clock.lap("commit")
    push.phases.update(clock.stages)


def push_weights(trainer: TrainerClient, rollouts: list[RolloutClient], version: int | None = None,
                 force_backend: str = "", timeout: float = 0, recompute_kv: bool = False,
                 pull: bool = False) -> PushReport:
    """Stage, then commit at once."""
    push = stage_weights(trainer, rollouts, version, force_backend, timeout, pull)
    commit_staged(rollouts, push, timeout, recompute_kv)
    return push


async def stage_weights_async(trainer: AsyncTrainerClient, rollouts: list[AsyncRolloutClient],
                              version: int | None = None, force_backend: str = "", timeout: float = 0,
                              pull: bool = False) -> PushReport:
    """Offer -> prepare on every replica -> publish: every replica then holds the new version in
    staging, received while it kept serving, and not yet live. Commit with commit_staged_async (or
    drop it with abort_staged_async). On failure nothing stays staged. pull: as stage_weights."""
    clock = Stopwatch()
    offer = await trainer.offer_weights(version, pull)
    clock.lap("offer")
    try:
        prepared = await settle(*(r.prepare_update(offer, force_backend, timeout) for r in rollouts))
        clock.lap("prepare")
        answers = [p.answer for p in prepared]
        pushed = _pushed(answers)
        pub = await trainer.publish_weights(offer.transfer_id, pushed, timeout) if pushed else None
    except BaseException:  # cancelled too: nothing may stay staged
        await abort_staged_async(rollouts)
        raise
    clock.lap("transfer")
    return _report(offer, pub, clock.stages, answers)


async def commit_staged_async(rollouts: list[AsyncRolloutClient], push: PushReport, timeout: float = 0,
                              recompute_kv: bool = False) -> None:
    """Makes a staged version live on every replica (each between two of its engine steps). Every
    commit is awaited; on a failure the others' staged updates are dropped, then the first error
    is raised (replicas that committed serve the new version, the rest their previous one)."""
    clock = Stopwatch()
    try:
        await settle(*(r.commit_update(push.version, timeout=timeout, recompute_kv=recompute_kv) for r in rollouts))
    except BaseException:
        await abort_staged_async(rollouts)
        raise
    clock.lap("commit")
    push.phases.update(clock.stages)


async def abort_staged_async(rollouts: list[AsyncRolloutClient]) -> None:
    """Drops what is staged on every replica (a no-op where nothing is); never raises."""
    await asyncio.shield(asyncio.gather(*(r.abort_update() for r in rollouts), return_exceptions=True))


async def push_weights_async(trainer: AsyncTrainerClient, rollouts: list[AsyncRolloutClient],
                             version: int | None = None, force_backend: str = "", timeout: float = 0,
                             recompute_kv: bool = False, pull: bool = False) -> PushReport:
    """Stage, then commit at once."""
    push = await stage_weights_async(trainer, rollouts, version, force_backend, timeout, pull)
    await commit_staged_async(rollouts, push, timeout, recompute_kv)
    return push
