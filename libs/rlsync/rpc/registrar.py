"""Member side of the coordinator's registry: register, heartbeat, register again after a
coordinator restart, deregister on shutdown (or, with a reason, while it cannot serve: `leave`).
Services with --coordinator run one.

All of it happens in the member's beacon (rlsync.rpc.beacon), a process of its own that this one
starts and watches (started again if it exits unasked), so that a member that keeps its GIL busy still
heartbeats. Here the event loop advances the progress counter (rlsync.common.progress) as it turns: a
heartbeat whose counter stood still, from a member whose CPU time stood still too, says the member is
stuck, and the coordinator does not count it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
import time

from rlsync.common.progress import PROGRESS
from rlsync.rpc.beacon import TOKEN_ENV, Shared

log = logging.getLogger(__name__)
TICK = 0.1  # seconds between two turns of the event loop that count as its progress
_RESPAWN_SECONDS = 5.0  # at most one beacon started again in this time (one that cannot start would spin)
_DISMISS_SECONDS = 15.0  # a leaving beacon waits for a registration in flight (10 s at most), then deregisters (3 s)


class Registrar:
    def __init__(self, coordinator: str, role: int, address: str, name: str = "", token: str = ""):
        self.coordinator, self.role, self.address, self.name, self.token = coordinator, role, address, name, token
        self._shared: Shared | None = None
        self._beacon: subprocess.Popen | None = None
        self._ticker: asyncio.Task | None = None
        self._since = time.monotonic()  # when it started: silent since then until the coordinator answers
        self._spawned = 0.0  # when its beacon last started
        # starts a beacon again, and dismisses one started after the member left (off the event loop; a thread of
        # its own, as the loop's executor may be busy)
        self._starter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlsync-beacon-start")

    @property
    def member_id(self) -> str:
        """The id the coordinator knows this member by ("" while not registered)."""
        return self._shared.read()[0] if self._beacon is not None else ""

    @property
    def lease(self) -> float:
        """The coordinator's lease, once registered (0 before)."""
        return self._shared.read()[1] if self._shared is not None else 0.0

    def silent_for(self) -> float:
        """Seconds since the coordinator last answered (a registration or a heartbeat)."""
        heard = self._shared.read()[2] if self._shared is not None else 0.0
        return time.monotonic() - max(heard, self._since)

    def start(self) -> None:
        """Registers and heartbeats until `leave()`; call it on the event loop whose turns count as progress."""
        if self._beacon is None:
            self._since = time.monotonic()
            self._shared = Shared()  # its own page: a beacon still leaving writes to the last one
            self._beacon = self._spawn()
            self._ticker = asyncio.create_task(self._tick())

    def _spawn(self) -> subprocess.Popen:
        progress, self._spawned = PROGRESS.shared(), time.monotonic()
        return subprocess.Popen(
            [sys.executable, "-m", "rlsync.rpc.beacon", "--coordinator", self.coordinator, "--role", str(self.role),
             "--address", self.address, "--name", self.name, "--member", str(os.getpid()),
             "--progress-fd", str(progress), "--shared-fd", str(self._shared.fd)],
            stdin=subprocess.PIPE, pass_fds=(progress, self._shared.fd), env={**os.environ, TOKEN_ENV: self.token})

    async def _tick(self) -> None:
        respawn: concurrent.futures.Future | None = None
        dead: subprocess.Popen | None = None  # the beacon the one starting replaces
        while True:
            await asyncio.sleep(TICK)
            PROGRESS.advance()
            if (respawn is None and self._beacon is not None and (code := self._beacon.poll()) is not None
                    and time.monotonic() - self._spawned > _RESPAWN_SECONDS):
                log.warning("the heartbeat process exited unasked (status %s): starting another", code)
                # Off the event loop: the start waits for the child's exec, seconds on a loaded host, and the
                # loop's turns meanwhile are this member's progress. It goes on as the same member (the id is in
                # the shared page). (A leave meanwhile has it dismissed once started; one that cancels this ticker
                # first drops it, and the new beacon, its stdin closed, deregisters and exits.)
                self._spawned, dead = time.monotonic(), self._beacon
                respawn = self._starter.submit(self._spawn)
            if respawn is not None and respawn.done():
                try:
                    beacon = respawn.result()
                except Exception:  # noqa: BLE001 - the ticker goes on: its turns are the member's progress
                    log.exception("could not start another heartbeat process; trying again in %.0fs", _RESPAWN_SECONDS)
                else:
                    if self._beacon is dead:
                        self._beacon = beacon
                    else:  # a leave (or a leave and a start) came meanwhile: this one goes too
                        self._starter.submit(_dismiss, beacon, "")
                respawn = None

    async def leave(self, reason: str = "") -> None:
        """Leaves the fleet until `start()` again. With a reason (this member cannot serve what it is
        asked), the coordinator abandons every call to it at once and says why; without, the calls in
        flight end on their own. Safe to call twice."""
        beacon, self._beacon = self._beacon, None  # (the ticker no longer starts it again)
        ticker, self._ticker = self._ticker, None  # (a start() meanwhile has its own)
        if beacon is not None:
            await asyncio.to_thread(_dismiss, beacon, reason)
        if ticker is not None:  # only now: until it has deregistered, its heartbeats show progress
            ticker.cancel()

    async def stop(self) -> None:
        """Leaves the fleet for good; safe to call twice."""
        await self.leave()


def _dismiss(beacon: subprocess.Popen, reason: str) -> None:
    """Tells a beacon to deregister, with the reason, and waits for it to exit (kills it past its time:
    the lease expires what it could not withdraw)."""
    try:
        beacon.stdin.write(reason.replace("\n", " ").encode() + b"\n")
        beacon.stdin.close()
    except OSError:
        pass  # it had exited
    try:
        beacon.wait(_DISMISS_SECONDS)
    except subprocess.TimeoutExpired:
        log.warning("the heartbeat process did not leave within %.0fs: killed", _DISMISS_SECONDS)
        beacon.kill()
        beacon.wait()
