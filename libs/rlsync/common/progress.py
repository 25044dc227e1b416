"""What counts as a process's progress. Its progress counter moves while it gets work done (its event
loop turns, transfer bytes land), and heartbeats carry it, so the coordinator tells a busy member from a
hung one. Heartbeats leave from a process of their own (rlsync.rpc.beacon), which runs on while this one
is stuck or busy: once `shared()`, the counter lives in a page of memory that process reads. A process
whose counter stands still while it computes (a step that keeps its GIL) shows its work in its CPU time,
and one starved of CPU in the time its working threads waited for one (`Watched`, `computing`): the
coordinator's lease and rank 0's watch over the other ranks count both."""

from __future__ import annotations

import mmap
import os

BUSY_SHARE = 0.05  # of a core: CPU time that grew at least so fast since the last evidence is evidence
BUSY_AT_LEAST = 0.02  # CPU-s, two clock ticks: a process's CPU time moves in steps of 10 ms
CPU_ALONE = 10  # leases: CPU time with no other sign of progress keeps a process this long at most
_TICK = os.sysconf("SC_CLK_TCK")


def computing(cpu_grown: float, seconds: float) -> bool:
    """Whether CPU time (run or waited for, `Watched`) that grew by `cpu_grown` over the `seconds` since the
    last evidence of progress is evidence itself: work, not the trickle of a stuck process's background
    threads. What it cannot tell from work: a thread that spins while the rest is stuck; so CPU time
    alone counts for CPU_ALONE leases at most."""
    return cpu_grown >= max(BUSY_SHARE * seconds, BUSY_AT_LEAST)


def _stat(pid: int | str) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name: [0] is field 3, the state."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def state_of(pid: int, started: str = "") -> tuple[str, float]:
    """A process's state letter (R, S, D, T, Z, ...; "" once it is gone, "?" where /proc cannot say) and its
    CPU seconds so far, every thread's user and system time, those that ended too (0 where /proc cannot
    say). started: its start time as `identity` says it; another process now under that pid is "" (gone)."""
    try:
        fields = _stat(pid)
    except FileNotFoundError:
        return ("" if os.path.isdir("/proc/self") else "?"), 0.0
    except OSError:  # (not ours to read: what it does is unknown, not over)
        return "?", 0.0
    if started and fields[19].decode() != started:
        return "", 0.0
    return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _TICK


class Watched:
    """Another process, as a beacon watches its member and rank 0 another rank: `sample()` gives its state
    and the seconds it wanted a CPU so far, its CPU time plus the time its working threads waited in a
    run queue for one (a starved process wants to run: busy, not hung). A working thread is one that ran
    RAN seconds or more since the last sample: the helpers of a stuck process, which wake for a moment,
    wait in run queues on a loaded host too, and that is not work."""

    RAN = 0.005

    def __init__(self, pid: int, started: str = ""):
        self.pid, self.started = pid, started
        self._threads: dict[str, tuple[int, int]] = {}  # tid: (ns run, ns waited), at the last sample
        self._waited = 0.0  # seconds its working threads waited, summed over samples (never decreases)

    def sample(self) -> tuple[str, float]:
        state, cpu = state_of(self.pid, self.started)
        if state and state != "?":
            self._waited += self._working_wait()
        return state, (cpu + self._waited) if cpu else 0.0

    def _working_wait(self) -> float:
        threads, waited = {}, 0
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return 0.0
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/schedstat", "rb") as f:
                    ran, wait = (int(x) for x in f.read().split()[:2])
            except (OSError, ValueError):
                continue  # (a thread that just ended; a kernel without schedstat)
            threads[tid] = ran, wait
            before = self._threads.get(tid)
            if before is not None and ran - before[0] >= self.RAN * 1e9:
                waited += max(0, wait - before[1])
        self._threads = threads
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
