"""Liveness of a sharded trainer's ranks: while one is silent, the trainer is out of the fleet.

A rank that hangs (SIGSTOP, a GIL held by a C extension, a host swapping) holds every collective the
others enter with it, while rank 0 goes on heartbeating the coordinator for a trainer that can serve
nothing: a sync would wait for its transfer's deadline. So every other rank bumps a counter in a
TCPStore that rank 0 hosts, from a thread of its own, every BEAT seconds. Rank 0 reads the counters as
often; once one has not moved for `lease()` seconds it calls `silent(rank, seconds)` (the publisher
deregisters with that reason, and the coordinator fails the sync under way at once), and once every
silent rank beats again, `back()` (the publisher registers again). A thread, not the loop's own
progress, so that a long training step is not silence. A step that keeps the GIL keeps that thread from
beating too: a rank that rank 0 can see in its own /proc (the same host and pid namespace, by the
identity the rank puts in the store) shows its work in its CPU time (rlsync.common.progress.computing)
and is busy, not silent, for CPU_ALONE leases at most; a stopped one (SIGSTOP) is silent whatever it
used before. What it cannot see is a rank whose process runs but whose work is stuck (a hung NCCL
kernel): that one the transfer's deadline catches.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from rlsync.common.progress import CPU_ALONE, Watched, computing, identity

log = logging.getLogger(__name__)

BEAT = 0.25  # seconds between a rank's beats, and between rank 0's reads
_STORE_TIMEOUT = datetime.timedelta(seconds=10)


def _key(rank: int) -> str:
    return f"rlsync/beat/{rank}"


def _where(rank: int) -> str:
    return f"rlsync/beat/{rank}/where"  # its identity (rlsync.common.progress.identity)


class RankBeats:
    """Rank 0's watch over the other ranks (`watch`), or another rank's beat (`beat`)."""

    def __init__(self, store: dist.TCPStore):
        self.store = store
        self.address = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def watch(cls, world: int, host: str, lease: Callable[[], float], silent: Callable[[int, float], None],
              back: Callable[[], None]) -> RankBeats:
        """Rank 0: hosts the store (at `address`, for the other ranks) and watches their counters."""
        self = cls(dist.TCPStore(host, 0, None, True, timeout=_STORE_TIMEOUT, wait_for_workers=False))
        self.address = f"{host}:{self.store.port}"
        self._run(lambda: self._watch(world, lease, silent, back), "rlsync-rank-watch")
        return self

    @classmethod
    def beat(cls, rank: int, address: str) -> RankBeats:
        """Any other rank: beats into rank 0's store at `address` until closed."""
        host, port = address.rsplit(":", 1)
        self = cls(dist.TCPStore(host, int(port), None, False, timeout=_STORE_TIMEOUT))
        self._run(lambda: self._beat(rank), f"rlsync-rank-beat-{rank}")
        return self

    def _run(self, target: Callable[[], None], name: str) -> None:
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * BEAT + _STORE_TIMEOUT.total_seconds())

    def _beat(self, rank: int) -> None:
        try:
            self.store.set(_where(rank), identity())
        except Exception as e:  # noqa: BLE001 - rank 0 sees its beats only
            log.debug("rank %d could not say where it runs: %s", rank, e)
        while not self._stop.wait(BEAT):
            try:
                self.store.add(_key(rank), 1)
            except Exception as e:  # noqa: BLE001 - rank 0 is gone or stopped: its own lease says so
                log.debug("rank %d could not beat: %s", rank, e)

    def _watch(self, world: int, lease: Callable[[], float], silent: Callable[[int, float], None],
               back: Callable[[], None]) -> None:
        now = time.monotonic()
        counts, moved, out = dict.fromkeys(range(1, world), -1), dict.fromkeys(range(1, world), now), set()
        pids: dict[int, Watched | None] = {}  # a rank rank 0 can see in its /proc (None: it cannot)
        cpu_at: dict[int, float] = {}  # its CPU seconds at its last evidence
        beat_at = dict(moved)  # its last beat: CPU time alone keeps it CPU_ALONE leases at most
        last = now
        while not self._stop.wait(BEAT):
            now = time.monotonic()
            if now - last > BEAT + lease() / 2:  # rank 0 stood still itself: silence it could not hear
                moved, beat_at = dict.fromkeys(moved, now), dict.fromkeys(beat_at, now)
            last = now
            for rank in counts:
                try:
                    count = self.store.add(_key(rank), 0)
                except Exception:  # noqa: BLE001 - its own store, in this process: not expected, not fatal
                    log.warning("reading rank %d's beat failed", rank, exc_info=True)
                    continue
                cpu = self._cpu(rank, pids)
                if cpu is not None:
                    cpu_at.setdefault(rank, cpu)
                busy = (cpu is not None and computing(cpu - cpu_at[rank], now - moved[rank])
                        and now - beat_at[rank] <= CPU_ALONE * lease())
                if count != counts[rank] or busy:
                    if count != counts[rank]:
                        beat_at[rank] = now
                    counts[rank], moved[rank] = count, now
                    if cpu is not None:
                        cpu_at[rank] = cpu
                    if rank in out:
                        out.discard(rank)
                        log.warning("rank %d of the trainer shows progress again", rank)
                        if not out:
                            back()
                elif rank not in out and now - moved[rank] > lease():
                    out.add(rank)
                    log.warning("rank %d of the trainer is silent for %.1fs", rank, now - moved[rank])
                    silent(rank, now - moved[rank])

    def _cpu(self, rank: int, pids: dict[int, Watched | None]) -> float | None:
        """A rank's CPU seconds, where rank 0 can read them and the rank runs (None: another host or pid
        namespace, not said yet, stopped, gone)."""
        if rank not in pids:
            try:
                if not self.store.check([_where(rank)]):
                    return None
                boot, space, pid, start = self.store.get(_where(rank)).decode().split()
            except Exception:  # noqa: BLE001 - its beats still count
                return None
            mine = identity().split()
            pids[rank] = Watched(int(pid), start) if [boot, space] == mine[:2] else None
        if pids[rank] is None:
            return None
        state, cpu = pids[rank].sample()
        return cpu if state and state not in "?TtZX" else None
