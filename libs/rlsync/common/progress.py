"""What counts as a process's progress. Its progress counter moves while it gets work done (its event
loop turns, transfer bytes land), and heartbeats carry it, so the coordinator tells a busy member from a
hung one. Heartbeats leave from a process of their own (rlsync.rpc.beacon), which runs on while this one
is stuck or busy: once `shared()`, the counter lives in a page of memory that process reads. A process
whose counter stands still while it computes (a step that keeps its GIL) shows its work in its CPU time,
and one starved of CPU in the time it waited for one (`state_of`, `computing`): the coordinator's lease
and rank 0's watch over the other ranks count both."""

from __future__ import annotations

import mmap
import os

BUSY_SHARE = 0.05  # of a core: CPU time that grew at least so fast since the last evidence is evidence
BUSY_AT_LEAST = 0.02  # CPU-s, two clock ticks: a process's CPU time moves in steps of 10 ms
CPU_ALONE = 10  # leases: CPU time with no other sign of progress keeps a process this long at most
_TICK = os.sysconf("SC_CLK_TCK")


def computing(cpu_grown: float, seconds: float) -> bool:
    """Whether CPU time (run or waited for, `state_of`) that grew by `cpu_grown` over the `seconds` since the
    last evidence of progress is evidence itself: work, not the trickle of a stuck process's background
    threads. What it cannot tell
    from work: a thread that spins while the rest is stuck; so CPU time alone counts for CPU_ALONE
    leases at most."""
    return cpu_grown >= max(BUSY_SHARE * seconds, BUSY_AT_LEAST)


def _stat(pid: int | str) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name: [0] is field 3, the state."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def state_of(pid: int, started: str = "") -> tuple[str, float]:
    """A process's state letter (R, S, D, T, Z, ...; "" once it is gone, "?" where /proc cannot say) and the
    seconds its threads wanted a CPU so far: the time they ran (user and system) and the time they waited
    in a run queue for one (0 where /proc cannot say). A starved process waits: it is busy, not hung.
    started: its start time as `identity` says it; another process now under that pid is "" (gone)."""
    try:
        fields = _stat(pid)
    except FileNotFoundError:
        return ("" if os.path.isdir("/proc/self") else "?"), 0.0
    except OSError:  # (not ours to read: what it does is unknown, not over)
        return "?", 0.0
    if started and fields[19].decode() != started:
        return "", 0.0
    return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK + _waited(pid)


def _waited(pid: int) -> float:
    """Seconds the process's live threads waited in a run queue (their schedstat; 0 without it)."""
    waited = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                waited += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass  # (a thread that just ended; a kernel without schedstat)
    return waited / 1e9


def identity() -> str:
    """This process, as another process may find it in its own /proc: "<boot id> <pid namespace> <pid>
    <start time>" (the same first two: the same kernel and namespace)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')} {os.getpid()} {_stat('self')[19].decode()}"
    except OSError:
        return f"- - {os.getpid()} -"  # (no /proc: nobody can read it)


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
