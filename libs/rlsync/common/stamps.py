"""Where a doorbell ring's time goes, across the processes it crosses: with RLSYNC_STAMP_DIR set, each
process appends a line per point it passes (its name and `time.perf_counter()`) to a file of its own
there, and `bench/ring_stamps.py` lines them up. On Linux perf_counter is CLOCK_MONOTONIC, one clock
for every process of a host. Unset (always, outside a profile), a point costs a call and a test or two.

The points, in the order a ring passes them (T: the ringing side, R: the rung):
T ring (ring_prepare begins), T written (its frame on the socket), R read (the doorbell has the
frame), R parsed (the request), R launched (a pull's copy queued), R replied (the answer on the
socket), T answered (the answer read), T copied (the copy's event passed). A sharded trainer's routed
send then: T queued (rank 0 queues it for its ranks), job (rank 0's ranks take it), checked (a rank can
send), agreed (every rank can), rostered (rank 0 put the roster), R roster (a receiver rank read it), R
pulled (its pulls are done), sent (a rank's send returned), added (the ranks added up what they sent),
published (rank 0's send is over), asked (the caller's PublishWeights arrived).

With RLSYNC_PROFILE_DIR set, each call of a coroutine function marked `profiled` runs under cProfile too,
written there as <pid>-<name>-<n>.prof (what runs on its thread meanwhile is in it as well)."""

from __future__ import annotations

import cProfile
import functools
import itertools
import os
import time
from typing import TextIO

_out: TextIO | None = None
_decided = False  # whether this process looked at RLSYNC_STAMP_DIR yet


def _forked() -> None:  # (a process forked from a preloaded one decides anew, with its own file)
    global _out, _decided
    _out, _decided = None, False


os.register_at_fork(after_in_child=_forked)


def stamp(point: str) -> None:
    global _out, _decided
    if not _decided:
        _decided = True
        if folder := os.environ.get("RLSYNC_STAMP_DIR"):
            os.makedirs(folder, exist_ok=True)
            _out = open(os.path.join(folder, f"{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115
    if _out is not None:
        _out.write(f"{point} {time.perf_counter():.9f}\n")


_calls = itertools.count()


def profiled(name: str):
    """Marks a coroutine function whose calls RLSYNC_PROFILE_DIR profiles (see above); unset, a call costs a
    lookup. A call that overlaps another profiled one runs unprofiled."""
    def mark(fn):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            folder = os.environ.get("RLSYNC_PROFILE_DIR")
            profile = cProfile.Profile() if folder else None
            try:
                if profile is not None:
                    profile.enable()
            except ValueError:  # another profile is on (an overlapping call)
                profile = None
            try:
                return await fn(*args, **kwargs)
            finally:
                if profile is not None:
                    profile.disable()
                    os.makedirs(folder, exist_ok=True)
                    profile.dump_stats(os.path.join(folder, f"{os.getpid()}-{name}-{next(_calls)}.prof"))
        return run
    return mark
