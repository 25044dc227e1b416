"""Who is in the fleet: members register and heartbeat. The lease is the one source of liveness, fed by
every evidence of progress (rlsync.coordinator.liveness): a member that shows none for half of it is
suspect (no new streams; probed), one that shows none for all of it leaves the rotation, and every call
the coordinator still waits on it for is abandoned then (its `gone`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from rlsync.client import AsyncRolloutClient, AsyncTrainerClient, RpcError
from rlsync.common import metrics
from rlsync.coordinator.liveness import Evidence, judge, lateness
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.errors import InvalidArgument
from rlsync.transfer.v1.transfer_pb2 import Doorbell, WeightFormat

log = logging.getLogger(__name__)
CHECK_EVERY = 0.25  # seconds between two checks of the members' evidence (a third of the lease at most)


@dataclass(eq=False)
class Member:
    id: str
    role: int
    address: str
    name: str
    client: AsyncRolloutClient | AsyncTrainerClient | None
    evidence: Evidence = field(default_factory=lambda: Evidence(time.monotonic(), time.monotonic()))
    state: str = "syncing"  # rollouts: syncing (being brought up to date) -> ready; gone when lost
    left: str = ""  # once gone: "<name> left the fleet: <why>"
    weight_version: int = 0
    backend: str = ""  # the channel its last update came through
    in_flight: int = 0  # gateway streams on it
    static: bool = False  # configured by address: never expires
    suspect: str = ""  # why the registry suspects it (no progress for half its lease); "" when it does not
    doorbell: Doorbell | None = None  # a rollout's (RolloutInfo.doorbell): a trainer on its host prepares it
    weight_format: WeightFormat | None = None  # a rollout's (RolloutInfo.weight_format): what the trainer sends it
    # Completed, with the reason, when the fleet loses it (its lease ran out, a new process took its
    # place, a sync found it dead): its client's calls in flight and later fail at once with Gone.
    gone: asyncio.Future | None = None

    @property
    def role_name(self) -> str:
        return "rollout" if self.role == pb.ROLE_ROLLOUT else "trainer"


class Registry:
    def __init__(self, token: str, lease: float):
        self.token = token
        self.lease = lease
        self.members: dict[str, Member] = {}
        self.changed = asyncio.Event()  # a rollout became ready or left
        self.on_join = None  # async callback(member) for a rollout that needs catching up
        self._background: set[asyncio.Task] = set()

    def spawn(self, coro) -> None:
        """Runs a coroutine in the background, keeping a reference until it is done."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def add(self, role: int, address: str, name: str = "", static: bool = False) -> Member:
        if role not in (pb.ROLE_ROLLOUT, pb.ROLE_TRAINER):
            raise InvalidArgument("Register needs role ROLE_ROLLOUT or ROLE_TRAINER")
        if not address:
            raise InvalidArgument("Register needs the address the coordinator can reach the service at")
        for m in list(self.members.values()):  # a restarted service registers again: replace it
            if m.address == address or (name and m.name == name and m.role == role):
                self.lose(m.id, "registered again", "replaced")
        client_cls = AsyncRolloutClient if role == pb.ROLE_ROLLOUT else AsyncTrainerClient
        gone = asyncio.get_running_loop().create_future()
        member = Member(uuid.uuid4().hex[:12], role, address, name or address, None, static=static, gone=gone)
        member.client = client_cls(address, token=self.token, timeout=None, retries=False, gone=gone,
                                   heard=lambda kind: self.saw(member, kind))
        if role == pb.ROLE_TRAINER:
            member.state = "ready"
        self.members[member.id] = member
        log.info("%s joined: %s at %s", member.role_name, member.name, address)
        if role == pb.ROLE_ROLLOUT and self.on_join is not None:
            self.spawn(self.on_join(member))
        return member

    def heartbeat(self, member_id: str, progress: int = 0, cpu_seconds: float = 0.0) -> bool:
        member = self.members.get(member_id)
        if member is None:
            return False
        if member.evidence.heartbeat(time.monotonic(), progress, cpu_seconds):
            self._cleared(member, member.evidence.kind)
        return True

    def saw(self, member: Member, kind: str) -> None:
        """Evidence of progress other than a heartbeat: a chunk it streamed ("tokens"), an answer ("answer")."""
        member.evidence.saw(time.monotonic(), kind)
        if member.suspect:
            self._cleared(member, kind)

    def _cleared(self, member: Member, kind: str) -> None:
        if member.suspect and member.state != "gone":
            log.info("%s shows progress again (%s): no longer suspect", member.name, kind)
            member.suspect = ""
            metrics.MEMBERS_CLEARED.labels(member.role_name, kind).inc()
            self.changed.set()

    def remove(self, member_id: str, why: str, reason: str = "deregistered") -> None:
        """A member that leaves in order (deregistered): what it has in flight ends on its own.
        reason: its label on rlsync_members_dropped_total."""
        member = self.members.pop(member_id, None)
        if member is not None:
            member.state, member.left = "gone", f"{member.name} left the fleet: {why}"
            log.warning("%s", member.left)
            metrics.MEMBERS_DROPPED.labels(member.role_name, reason).inc()
            self.changed.set()
            self.spawn(_close_when_idle(member))

    def lose(self, member_id: str, why: str, reason: str) -> None:
        """A member the fleet lost (silent, replaced, found dead): it leaves, and every call to it is
        abandoned now, as if it had died (a hung process would never answer them)."""
        member = self.members.get(member_id)
        self.remove(member_id, why, reason)
        if member is not None and member.gone is not None and not member.gone.done():
            member.gone.set_result(member.left)

    async def expire_forever(self) -> None:
        tick = min(self.lease / 3, CHECK_EVERY)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if late := lateness(now, last, tick):  # the loop was behind, or this process stood still
                if late > self.lease / 2:
                    log.warning("the coordinator stood still for %.1fs: it is not its members' silence", late)
                for m in self.members.values():
                    m.evidence.credit(late, now)
            last = now
            for m in list(self.members.values()):
                if not m.static:
                    self.judge(m, now)

    def judge(self, member: Member, now: float) -> None:
        """Suspects or drops a member that shows no progress (rlsync.coordinator.liveness)."""
        verdict = judge(member.evidence, now, self.lease)
        if verdict.action == "drop":
            self.lose(member.id, verdict.why, verdict.reason)
        elif verdict.action == "suspect" and not member.suspect:
            member.suspect = verdict.why
            log.warning("%s is suspect: %s; no new work goes to it until it shows progress, and it leaves the "
                        "fleet in %.1fs if it shows none", member.name, verdict.why,
                        self.lease - (now - member.evidence.progress_at))
            metrics.MEMBERS_SUSPECTED.labels(member.role_name, verdict.reason).inc()
            self.changed.set()
            self.spawn(self._probe(member))

    async def _probe(self, member: Member) -> None:
        """Asks a suspect member whether it is there at all (gRPC health): its answer is evidence (the
        client reports it), its silence changes nothing; the call is abandoned if the lease drops it."""
        try:
            await member.client.health(timeout=self.lease)
        except RpcError:
            pass

    def rollouts(self, state: str | None = "ready") -> list[Member]:
        return [m for m in self.members.values() if m.role == pb.ROLE_ROLLOUT and (state is None or m.state == state)]

    def trainer(self) -> Member | None:
        return next((m for m in self.members.values() if m.role == pb.ROLE_TRAINER), None)


async def _close_when_idle(member: Member, limit: float = 600.0) -> None:
    """Closes a departed member's channel once the gateway's streams on it are done: a replica that
    drains (scaled down) finishes the requests it has."""
    deadline = time.monotonic() + limit
    while member.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await member.client.close()
