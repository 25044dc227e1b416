"""Rank 0's watch over the other ranks' beats (rlsync.publish.liveness), over a real TCPStore: a rank
that stops beating is reported silent once, after the lease; beating again brings the trainer back."""

from __future__ import annotations

import time

from rlsync.publish.liveness import BEAT, RankBeats


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
