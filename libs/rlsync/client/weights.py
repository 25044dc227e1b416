"""Pushing the trainer's weights into rollout replicas: offer -> prepare on every replica ->
publish -> commit on every replica (a replica on the trainer's GPU pulls the bytes while it
prepares; when all do, there is no publish). A replica on the trainer's host is prepared by the
trainer itself, rung at its doorbell as soon as the offer exists (no gRPC round trip through the
caller); when that is every replica, the trainer also starts sending as soon as they answered, and
the publish collects that send. The coordinator wraps this in its sync sequences; scripts and tests
can call it directly."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from rlsync.client.base import until_gone
from rlsync.client.rollout import AsyncRolloutClient, RolloutClient
from rlsync.client.trainer import AsyncTrainerClient, TrainerClient
from rlsync.common.aio import settle
from rlsync.common.stamps import stamp
from rlsync.common.timing import Stopwatch, total
from rlsync.errors import Relayed, RlsyncError
from rlsync.rollout.v1 import rollout_pb2
from rlsync.rpc.doorbell import Lines, Unreachable, ring
from rlsync.transfer.handshake import host_id
from rlsync.transfer.v1.transfer_pb2 import Backend, Doorbell, Facts, MappedTensors, Offer, Routing, WeightFormat

if TYPE_CHECKING:  # the trainer's own process rings bells and waits on copies: the coordinator never loads torch
    import torch

log = logging.getLogger(__name__)


@dataclass
class PushReport:
    version: int
    bytes: int
    backends: dict[str, int]
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    profile: dict[str, float] = field(default_factory=dict)  # the transfer phase broken down
    channels: list[str] = field(default_factory=list)  # the backend each rollout chose, in their order
    wire_bytes: int = 0  # what the trainer sent (deltas: only what changed; pulled replicas copied theirs)
    rank_bytes: list[int] = field(default_factory=list)  # a sharded trainer: what each of its ranks sent


async def _ring_here(doorbells: list[Doorbell], ring_one) -> list:
    """ring_one(doorbell) at every doorbell on this host, all at once -> a result per doorbell, in
    their order: None for one on another host or where nobody answers (a replica restarting, or a
    host id shared across network namespaces: nothing was delivered). The first other failure is
    raised, once every ring has settled."""
    async def one(d: Doorbell):
        try:
            return await ring_one(d)
        except Unreachable as e:
            log.warning("%s", e)
            return None

    here = host_id()
    mine = [i for i, d in enumerate(doorbells) if d.host_id == here and d.address]
    results = [None] * len(doorbells)
    for i, result in zip(mine, await settle(*(one(doorbells[i]) for i in mine))):
        results[i] = result
    return results


_BELL_VALUES = itertools.count()  # one per ring that writes bells: a copy started by an older one is refused


async def ring_prepare(offer: Offer, doorbells: list[Doorbell], token: str, force_backend: str = "",
                       timeout: float = 0, lines: Lines | None = None,
                       bells: Mapping[str, torch.Tensor] | None = None, final: torch.cuda.Event | None = None
                       ) -> tuple[list, float]:
    """The trainer's side of OfferWeightsRequest.ring: a PrepareUpdate of `offer` at every doorbell
    on this host, all at once. -> (a Rung per doorbell, seconds until the last answered). A doorbell
    on another host or nobody answers at is left unrung, for the caller's PrepareUpdate. The first
    refusal is raised, with the replica's status and name (what others prepared stays prepared:
    the caller aborts them, as after a failed PrepareUpdate). `bells`: the mapped bells of replicas
    that hold the offer's memory, by doorbell address: each is written first, which starts the copy
    that replica armed (rlsync.transfer.armed), once the GPU has passed `final` (recorded as the offer was made,
    after its weights: the publisher's `final`; None: after what the current stream holds now)."""
    from rlsync.trainer.v1.trainer_pb2 import Rung
    from rlsync.transfer.armed import ring_bell
    from rlsync.transfer.copied import sender_device, wait_copied

    stamp("ring")
    start = time.perf_counter()
    ours = MappedTensors(waits=len(offer.mapped.ipc) > 0)  # the answers come back here: this waits for the copies
    # (a sharded trainer's offer naming its ranks' memories: its ranks' weights were final on the GPU when they
    # described them)
    waits = ours.waits or len(offer.routing.memories) > 0
    rung = {d.address: bells[d.address] for d in doorbells if bells and d.address in bells} if waits else {}
    if rung:  # after the offer, so after the weights on this stream
        ours.bell = next(_BELL_VALUES) % (1 << 30) + 1
        for flag in rung.values():
            ring_bell(flag, ours.bell, final)
    requests = _requests(offer, doorbells, rung, ours, force_backend, timeout)

    async def prepare(d: Doorbell):
        who = f"replica {d.name}"
        response = await ring(d.address, token, "PrepareUpdate", requests[d.address],
                              rollout_pb2.PrepareUpdateResponse.FromString, (timeout or 300) + 30, who, lines)
        if response is not None and response.answer.copied:  # a pull answered once its copy was queued
            response.answer.stages["copied"] = await wait_copied(
                response.answer.copied, sender_device(offer.mapped, offer.facts), timeout or 300, who)
            stamp("copied")
        return response

    answers = await _ring_here(doorbells, prepare)
    seconds = time.perf_counter() - start if any(a is not None for a in answers) else 0.0
    return [Rung() if a is None else Rung(rung=True, answer=a.answer) for a in answers], seconds


def _requests(offer: Offer, doorbells: list[Doorbell], rung: Collection[str], ours: MappedTensors, force_backend: str,
              timeout: float) -> dict[str, bytes]:
    """Each doorbell's PrepareUpdateRequest bytes, by address: the bell value `ours` carries only for the replicas
    whose bell was written (`rung`); another (one whose bell this trainer could not open, say) would adopt a copy
    armed behind its bell as one about to start, which nothing starts."""
    request = _prepare_request(offer, ours, force_backend, timeout)
    if not ours.bell or all(d.address in rung for d in doorbells):
        return {d.address: request for d in doorbells}
    unbelled = _prepare_request(offer, MappedTensors(waits=ours.waits), force_backend, timeout)
    return {d.address: request if d.address in rung else unbelled for d in doorbells}


def _prepare_request(offer: Offer, ours: MappedTensors, force_backend: str, timeout: float) -> bytes:
    """The bytes of PrepareUpdateRequest(offer=`offer`, its mapped tensors' waits and bell as `ours`
    says, ...) without a copy of the offer (its tensor list is most of it, and this is on the way
    to the replicas' copies): the offer's bytes as the request's field 1, then a request whose
    field 1 sets those two. A message field that comes twice parses as the two merged, which sets
    fields and never clears them: the offer's own waits and bell are unset (only a ring sets them,
    on its request)."""
    head = offer.SerializeToString()
    rest = rollout_pb2.PrepareUpdateRequest(force_backend=force_backend, timeout=timeout)
    if ours.waits or ours.bell:
        rest.offer.mapped.CopyFrom(ours)
    return b"\x0a" + _varint(len(head)) + head + rest.SerializeToString()  # (field 1, length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


HOLD_TIMEOUT = 30.0  # mapping or closing a few storages takes milliseconds


async def _ring_or_none(d: Doorbell, token: str, method: str, request, parse, otherwise: str,
                        expected: tuple = (), lines: Lines | None = None):
    """The response of `method` at `d`, or None once it failed and was logged with what follows
    (`otherwise`); a refusal with a code in `expected` is logged at debug level only."""
    try:
        return await ring(d.address, token, method, request, parse, HOLD_TIMEOUT, f"replica {d.name}", lines)
    except RlsyncError as e:
        quiet = isinstance(e, Relayed) and e.code in expected
        log.log(logging.DEBUG if quiet else logging.WARNING, "%s: %s", e, otherwise)
        return None


async def ring_hold(holder: str, mapped: MappedTensors, facts: Facts, doorbells: list[Doorbell],
                    token: str, lines: Lines | None = None, routing: Routing | None = None
                    ) -> list[tuple[Doorbell, rollout_pb2.HoldWeightsResponse]]:
    """The trainer's side of OnloadRequest.ring: asks every replica on this host to keep its
    weights mapped until ring_release. -> (doorbell, its answer) of those that hold them.
    A replica that cannot (another GPU, an engine that receives elsewhere) or does not answer is
    left to map at each update: holding only saves time, so nothing fails here."""
    request = rollout_pb2.HoldWeightsRequest(holder=holder, mapped=mapped, facts=facts, routing=routing)
    held = await _ring_here(doorbells, lambda d: _ring_or_none(
        d, token, "HoldWeights", request, rollout_pb2.HoldWeightsResponse.FromString,
        "it maps the weights at each update instead", (grpc.StatusCode.FAILED_PRECONDITION,), lines))
    return [(d, h) for d, h in zip(doorbells, held) if h is not None]


async def ring_release(holder: str, doorbells: list[Doorbell], token: str, lines: Lines | None = None) -> int:
    """Asks the replicas that hold the trainer's weights to let go (before it offloads: memory
    another process maps is not freed). -> how many did. One that is gone released by dying; one
    that does not answer keeps that memory from the GPU until it next hears from this holder,
    and is logged."""
    request = rollout_pb2.ReleaseWeightsRequest(holder=holder)
    released = await _ring_here(doorbells, lambda d: _ring_or_none(
        d, token, "ReleaseWeights", request, rollout_pb2.ReleaseWeightsResponse.FromString,
        "the trainer's memory it maps is not freed by this offload", lines=lines))
    return sum(r is not None for r in released)


def _pushed(answers: list) -> list:
    """The answers the trainer must send to: the others pulled while they prepared (cuda_ipc)."""
    return [a for a in answers if not a.pull]


def _report(offer, pub, phases: dict[str, float], answers: list, rung: list[bool] | None = None,
            ring_seconds: float = 0.0) -> PushReport:
    """The profile: each stage of the replicas' prepare (a pull's copy included) at its slowest
    replica; prepare_ring, what the rung replicas' prepare took beyond the slowest one's stages (the
    doorbell round trip from the trainer), and prepare_rpc, the same for the others (a gRPC
    round trip from the caller); then, for a publish, rpc (the transfer phase less the trainer's own
    send() time) and the trainer's and receivers' stages of the send."""
    channels = [Backend.Name(a.backend).removeprefix("BACKEND_").lower() for a in answers]
    rung = rung or [False] * len(answers)
    profile: dict[str, float] = {}
    backends: dict[str, int] = dict(pub.backends) if pub is not None else {}
    for a, name in zip(answers, channels):
        if a.pull:
            backends[name] = backends.get(name, 0) + a.ranks
        for stage, seconds in a.stages.items():
            profile[f"receiver_{stage}"] = max(profile.get(f"receiver_{stage}", 0.0), seconds)

    def slowest(by_ring: bool) -> float:
        return max((total(a.stages) for a, r in zip(answers, rung) if r == by_ring), default=0.0)

    if any(rung):
        profile["prepare_ring"] = max(ring_seconds - slowest(True), 0.0)
    if not all(rung):
        profile["prepare_rpc"] = max(phases["prepare"] - ring_seconds - slowest(False), 0.0)
    if pub is not None:
        profile["rpc"] = max(phases["transfer"] - pub.seconds, 0.0)
        for stage, seconds in pub.profile.items():  # the slowest receiver, pulled or pushed
            profile[stage] = max(profile.get(stage, 0.0), seconds)
    return PushReport(offer.manifest.version, sum(t.nbytes for t in offer.manifest.tensors), backends, phases,
                      profile, channels, pub.wire_bytes if pub is not None else 0,
                      list(pub.rank_bytes) if pub is not None else [])


def _bells(doorbells: list[Doorbell | None] | None, n: int) -> list[Doorbell]:
    return [d if d is not None else Doorbell() for d in doorbells or [None] * n]


def _all_rung(bells: list[Doorbell]) -> bool:
    """Every replica has a doorbell: if the trainer rings them all, it may send at once (it then
    holds every answer), and PublishWeights collects that send."""
    return bool(bells) and all(d.address for d in bells)


def _rung(bells: list[Doorbell], offered) -> list:
    """Each replica's answer when the trainer rang it, else None (to be prepared by the caller)."""
    rung, answers = iter(offered.rung), []
    for d in bells:  # the request rang the doorbells that have an address, in this order
        r = next(rung) if d.address else None
        answers.append(r.answer if r is not None and r.rung else None)
    return answers


def _prepared(clock: Stopwatch, offer, offered, pub, answers: list, rest: list[int]) -> PushReport:
    """The report, once the rung replicas' prepare (inside the offer call, from the moment the
    offer existed) is charged to the prepare phase."""
    clock.stages["offer"] -= offered.ring_seconds
    clock.stages["prepare"] += offered.ring_seconds
    return _report(offer, pub, clock.stages, answers, [i not in rest for i in range(len(answers))],
                   offered.ring_seconds)


def stage_weights(trainer: TrainerClient, rollouts: list[RolloutClient], version: int | None = None,
                  force_backend: str = "", timeout: float = 0, pull: bool = False,
                  doorbells: list[Doorbell | None] | None = None, hold: bool = False,
                  fmt: WeightFormat | None = None) -> PushReport:
    """Offer -> prepare on every replica -> publish, one call after the other (stage_weights_async
    overlaps the replicas). Every replica then holds the new version in staging; commit it with
    commit_staged (or RolloutClient.abort_update). On failure nothing stays staged.

    pull: replicas on the trainer's GPU copy the weights while they prepare (no publish for them);
    only while nothing trains, offloads or loads until this returns.
    doorbells: each replica's (RolloutInfo.doorbell; None: none); the trainer prepares those on its
    host itself, the others are prepared here. hold: those on its GPU keep its weights mapped from
    now on (OfferWeightsRequest.hold). fmt: the replicas' weight format (RolloutInfo.weight_format), which
    the trainer quantizes to."""
    clock, bells = Stopwatch(), _bells(doorbells, len(rollouts))
    try:
        offered = trainer.offer_weights(version, pull, [d for d in bells if d.address], force_backend, timeout,
                                        hold, publish=_all_rung(bells), fmt=fmt)
        offer, answers = offered.offer, _rung(bells, offered)
        clock.lap("offer")
        rest = [i for i, a in enumerate(answers) if a is None]
        for i in rest:
            answers[i] = rollouts[i].prepare_update(offer, force_backend, timeout).answer
        clock.lap("prepare")
        pushed = _pushed(answers)
        pub = trainer.publish_weights(offer.transfer_id, pushed, timeout) if pushed else None
    except Exception:
        for r in rollouts:  # best effort: the first error is the one to report
            with contextlib.suppress(Exception):
                r.abort_update()
        raise
    clock.lap("transfer")
    return _prepared(clock, offer, offered, pub, answers, rest)


def commit_staged(rollouts: list[RolloutClient], push: PushReport, timeout: float = 0,
                  recompute_kv: bool = False) -> None:
    clock = Stopwatch()
    done = [r.commit_update(push.version, timeout=timeout, recompute_kv=recompute_kv) for r in rollouts]
    clock.lap("commit")
    _committed(push, clock, done)


def _committed(push: PushReport, clock: Stopwatch, done: list) -> None:
    """The commit's phase, and the engines' own stages of the switch at the slowest replica (commit_<stage>)."""
    push.phases.update(clock.stages)
    for response in done:
        for stage, seconds in response.stages.items():
            push.phases[f"commit_{stage}"] = max(push.phases.get(f"commit_{stage}", 0.0), seconds)


def push_weights(trainer: TrainerClient, rollouts: list[RolloutClient], version: int | None = None,
                 force_backend: str = "", timeout: float = 0, recompute_kv: bool = False,
                 pull: bool = False, doorbells: list[Doorbell | None] | None = None,
                 hold: bool = False, fmt: WeightFormat | None = None) -> PushReport:
    """Stage, then commit at once."""
    push = stage_weights(trainer, rollouts, version, force_backend, timeout, pull, doorbells, hold, fmt)
    commit_staged(rollouts, push, timeout, recompute_kv)
    return push


async def stage_weights_async(trainer: AsyncTrainerClient, rollouts: list[AsyncRolloutClient],
                              version: int | None = None, force_backend: str = "", timeout: float = 0,
                              pull: bool = False, doorbells: list[Doorbell | None] | None = None,
                              hold: bool = False, fmt: WeightFormat | None = None) -> PushReport:
    """Offer -> prepare on every replica -> publish: every replica then holds the new version in
    staging, received while it kept serving, and not yet live. Commit with commit_staged_async (or
    drop it with abort_staged_async). On failure nothing stays staged. pull, hold: as stage_weights.
    doorbells: each replica's (RolloutInfo.doorbell; None or empty: none); the trainer prepares
    those on its host itself, the others are prepared here."""
    clock, bells = Stopwatch(), _bells(doorbells, len(rollouts))
    try:
        # The trainer's calls wait on the replicas (it rings them, then sends to them): a replica that is
        # gone (its client's `gone`, see AsyncClient) abandons them at once.
        gone = [getattr(r, "gone", None) for r in rollouts]
        offered = await until_gone(trainer.offer_weights(version, pull, [d for d in bells if d.address], force_backend,
                                                         timeout, hold, publish=_all_rung(bells), fmt=fmt),
                                   *gone, method="OfferWeights")
        offer, answers = offered.offer, _rung(bells, offered)
        clock.lap("offer")
        rest = [i for i, a in enumerate(answers) if a is None]
        prepared = await settle(*(rollouts[i].prepare_update(offer, force_backend, timeout) for i in rest))
        for i, p in zip(rest, prepared):
            answers[i] = p.answer
        clock.lap("prepare")
        pushed = _pushed(answers)
        pub = await until_gone(trainer.publish_weights(offer.transfer_id, pushed, timeout), *gone,
                               method="PublishWeights") if pushed else None
    except BaseException:  # cancelled too: nothing may stay staged
        await abort_staged_async(rollouts)
        raise
    clock.lap("transfer")
    return _prepared(clock, offer, offered, pub, answers, rest)


async def commit_staged_async(rollouts: list[AsyncRolloutClient], push: PushReport, timeout: float = 0,
                              recompute_kv: bool = False) -> None:
    """Makes a staged version live on every replica (each between two of its engine steps). Every
    commit is awaited; on a failure the others' staged updates are dropped, then the first error
    is raised (replicas that committed serve the new version, the rest their previous one)."""
    clock = Stopwatch()
    try:
        done = await settle(*(r.commit_update(push.version, timeout=timeout, recompute_kv=recompute_kv)
                              for r in rollouts))
    except BaseException:
        await abort_staged_async(rollouts)
        raise
    clock.lap("commit")
    _committed(push, clock, done)


async def abort_staged_async(rollouts: list[AsyncRolloutClient]) -> None:
    """Drops what is staged on every replica (a no-op where nothing is); never raises."""
    await asyncio.shield(asyncio.gather(*(r.abort_update() for r in rollouts), return_exceptions=True))


async def push_weights_async(trainer: AsyncTrainerClient, rollouts: list[AsyncRolloutClient],
                             version: int | None = None, force_backend: str = "", timeout: float = 0,
                             recompute_kv: bool = False, pull: bool = False,
                             doorbells: list[Doorbell | None] | None = None, hold: bool = False,
                             fmt: WeightFormat | None = None) -> PushReport:
    """Stage, then commit at once."""
    push = await stage_weights_async(trainer, rollouts, version, force_backend, timeout, pull, doorbells, hold, fmt)
    await commit_staged_async(rollouts, push, timeout, recompute_kv)
    return push
