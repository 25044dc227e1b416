"""What counts as a process's progress. Its progress counter moves while it gets work done (its event
loop turns, transfer bytes land), and heartbeats carry it, so the coordinator tells a busy member from a
hung one. Heartbeats leave from a process of their own (rlsync.rpc.beacon), which runs on while this one
is stuck or busy: once `shared()`, the counter lives in a page of memory that process reads. A process
whose counter stands still while it computes (a step that keeps its GIL) shows its work in its CPU time
(`state_of`, `computing`): the coordinator's lease and rank 0's watch over the other ranks count both."""

from __future__ import annotations

import mmap
import os

BUSY_SHARE = 0.05  # of a core: CPU time that grew at least so fast since the last evidence is evidence
BUSY_AT_LEAST = 0.02  # CPU-s, two clock ticks: a process's CPU time moves in steps of 10 ms
_TICK = os.sysconf("SC_CLK_TCK")


def computing(cpu_grown: float, seconds: float) -> bool:
    """Whether CPU time that grew by `cpu_grown` over the `seconds` since the last evidence of progress is
    evidence itself: work, not the trickle of a stuck process's background threads. What it cannot tell
    from work: a process that spins without getting anywhere (a deadline catches that one)."""
    return cpu_grown >= max(BUSY_SHARE * seconds, BUSY_AT_LEAST)


def state_of(pid: int) -> tuple[str, float]:
    """A process's state letter (R, S, D, T, Z, ...; "" once it is gone, "?" where /proc cannot say) and its
    CPU seconds so far, every thread's user and system time (0 where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return ("" if os.path.isdir("/proc/self") else "?"), 0.0
    except OSError:  # (not ours to read: what it does is unknown, not over)
        return "?", 0.0
    return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK


class Progress:
    """A counter that only needs to change while work is done: `advance` from any thread, unlocked (a
    lost increment under a race is harmless; the next one moves it again)."""

    __slots__ = ("_cell", "_fd")

    def __init__(self) -> None:
        self._cell: list[int] | memoryview = [1]  # 0 on the wire means "not reported"
        self._fd = -1
        os.register_at_fork(after_in_child=self._forked)

    @property
    def count(self) -> int:
        return self._cell[0]

    def advance(self, n: int = 1) -> None:
        self._cell[0] += n

    def shared(self) -> int:
        """The descriptor of a memory file (memfd) the counter lives in from now on, for a beacon to read."""
        if self._fd < 0:
            fd = os.memfd_create("rlsync-progress")  # (closed at exec: a beacon gets it by pass_fds)
            os.ftruncate(fd, mmap.PAGESIZE)
            cell = memoryview(mmap.mmap(fd, mmap.PAGESIZE)).cast("Q")
            cell[0] = self.count
            self._cell, self._fd = cell, fd
        return self._fd

    def _forked(self) -> None:
        """A forked child (a service forked from a preloaded image) counts its own progress."""
        if self._fd >= 0:
            os.close(self._fd)
        self._cell, self._fd = [self.count], -1


PROGRESS = Progress()
