"""Who is in the fleet: members register and heartbeat; a silent one leaves the rotation, and every
call the coordinator still waits on it for is abandoned then (its `gone`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from rlsync.client import AsyncRolloutClient, AsyncTrainerClient
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from rlsync.errors import InvalidArgument
from rlsync.transfer.v1.transfer_pb2 import Doorbell

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Member:
    id: str
    role: int
    address: str
    name: str
    client: AsyncRolloutClient | AsyncTrainerClient
    last_seen: float = field(default_factory=time.monotonic)
    state: str = "syncing"  # rollouts: syncing (being brought up to date) -> ready; gone when lost
    left: str = ""  # once gone: "<name> left the fleet: <why>"
    weight_version: int = 0
    backend: str = ""  # the channel its last update came through
    in_flight: int = 0  # gateway streams on it
    static: bool = False  # configured by address: never expires
    doorbell: Doorbell | None = None  # a rollout's (RolloutInfo.doorbell): a trainer on its host prepares it
    # Completed, with the reason, when the fleet loses it (its lease ran out, a new process took its
    # place, a sync found it dead): its client's calls in flight and later fail at once with Gone.
    gone: asyncio.Future | None = None


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
                self.lose(m.id, "registered again")
        client_cls = AsyncRolloutClient if role == pb.ROLE_ROLLOUT else AsyncTrainerClient
        gone = asyncio.get_running_loop().create_future()
        member = Member(uuid.uuid4().hex[:12], role, address, name or address,
                        client_cls(address, token=self.token, timeout=None, retries=False, gone=gone), static=static,
                        gone=gone)
        if role == pb.ROLE_TRAINER:
            member.state = "ready"
        self.members[member.id] = member
        log.info("%s joined: %s at %s", "rollout" if role == pb.ROLE_ROLLOUT else "trainer", member.name, address)
        if role == pb.ROLE_ROLLOUT and self.on_join is not None:
            self.spawn(self.on_join(member))
        return member

    def heartbeat(self, member_id: str) -> bool:
        member = self.members.get(member_id)
        if member is None:
            return False
        member.last_seen = time.monotonic()
        return True

    def remove(self, member_id: str, why: str) -> None:
        """A member that leaves in order (deregistered): what it has in flight ends on its own."""
        member = self.members.pop(member_id, None)
        if member is not None:
            member.state, member.left = "gone", f"{member.name} left the fleet: {why}"
            log.warning("%s", member.left)
            self.changed.set()
            self.spawn(_close_when_idle(member))

    def lose(self, member_id: str, why: str) -> None:
        """A member the fleet lost (silent, replaced, found dead): it leaves, and every call to it is
        abandoned now, as if it had died (a hung process would never answer them)."""
        member = self.members.get(member_id)
        self.remove(member_id, why)
        if member is not None and member.gone is not None and not member.gone.done():
            member.gone.set_result(member.left)

    async def expire_forever(self) -> None:
        tick = self.lease / 3
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last > tick + self.lease / 2:  # this process stood still (stopped, starved, swapped):
                log.warning("the coordinator stood still for %.1fs: every member gets a lease from now", now - last)
                for m in self.members.values():  # silence it could not hear is not theirs
                    m.last_seen = now
            last = now
            for m in list(self.members.values()):
                if not m.static and now - m.last_seen > self.lease:
                    self.lose(m.id, f"no heartbeat for {now - m.last_seen:.1f}s")

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
