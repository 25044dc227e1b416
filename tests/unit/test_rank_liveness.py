"""Rank 0's watch over the other ranks' beats (rlsync.publish.liveness), over a real TCPStore: a rank
that stops beating is reported silent once, after the lease; beating again brings the trainer back. A
rank process that keeps its GIL for three leases (no thread of its own can beat) is busy, not silent;
stopped, it is silent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlsync.publish.liveness import BEAT, RankBeats

RANK = """
import sys, time
from rlsync.publish.liveness import RankBeats
sys.path.insert(0, sys.argv[3])
from gil_member import busy
beats = RankBeats.beat(1, sys.argv[1])
time.sleep(4 * 0.25)
print("holding", flush=True)
for _ in busy(float(sys.argv[2]), call=float(sys.argv[2]) / 2):  # each call longer than the lease
    pass
print("done", flush=True)
time.sleep(600)
"""


def wait_for(events: list, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(events) < n:
        assert time.monotonic() < deadline, events
        time.sleep(0.02)


def test_a_silent_rank_is_reported_once_after_the_lease_and_back_when_it_beats_again():
    lease, events = 4 * BEAT, []
    watch = RankBeats.watch(3, "127.0.0.1", lambda: lease, lambda r, s: events.append(("silent", r, s)),
                            lambda: events.append(("back",)))
    beats = {r: RankBeats.beat(r, watch.address) for r in (1, 2)}
    try:
        time.sleep(3 * lease)
        assert events == [], "ranks that beat are not silent"
        stopped = time.monotonic()  # its last beat is at most BEAT before
        beats.pop(2).close()
        wait_for(events, 1)
        (what, rank, seconds), waited = events[0], time.monotonic() - stopped
        assert (what, rank) == ("silent", 2) and lease < seconds and lease - BEAT <= waited < lease + 4 * BEAT, events
        time.sleep(2 * lease)
        assert len(events) == 1, "reported once, not at every read"
        beats[2] = RankBeats.beat(2, watch.address)
        wait_for(events, 2)
        assert events[1] == ("back",)
    finally:
        for b in beats.values():
            b.close()
        watch.close()


def test_a_rank_that_keeps_its_gil_is_busy_not_silent_and_a_stopped_one_is_silent():
    lease, events = [60.0], []  # (the lease while the rank starts up: torch takes seconds to import)
    watch = RankBeats.watch(2, "127.0.0.1", lambda: lease[0], lambda r, s: events.append(("silent", r, s)),
                            lambda: events.append(("back",)))
    rank = subprocess.Popen([sys.executable, "-c", RANK, watch.address, str(12 * BEAT),
                             str(Path(__file__).parents[1])], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "holding\n"
        lease[0] = 4 * BEAT
        assert rank.stdout.readline() == "done\n"
        assert events == [], "its CPU time showed it at work while it could not beat"
        os.kill(rank.pid, signal.SIGSTOP)
        wait_for(events, 1)
        assert events[0][:2] == ("silent", 1), events
    finally:
        rank.kill()
        rank.wait()
        watch.close()
