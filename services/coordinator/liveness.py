"""When the registry suspects a member and when it drops one: pure rules over what it last heard (no
I/O, no clock of its own).

Liveness is progress, not punctuality. Evidence of progress is anything the member gets done that the
coordinator sees: a heartbeat whose progress counter moved (its event loop turned, transfer bytes
landed) or whose CPU time grew by a twentieth of a core or more (it computes, its event loop held up by
a step that keeps the GIL), a chunk it streamed, any answer to a call. A member that shows none for half
its lease is suspect (no new work goes to it; it is probed); one that shows none for its whole lease
leaves, as a hung or dead one always has (the CPU rule: rlsync.common.progress.computing)."""

from __future__ import annotations

from dataclasses import dataclass

from rlsync.common.progress import BUSY_SHARE, CPU_ALONE, computing

SUSPECT_AFTER = 0.5  # of the lease without evidence of progress


@dataclass
class Evidence:
    """What the registry last heard from one member (monotonic seconds)."""

    progress_at: float  # the last evidence of progress, of any kind
    heartbeat_at: float  # the last heartbeat, whether it showed progress or not
    counter: int = 0  # the member's progress counter at its last heartbeat (0: it reports none)
    kind: str = "registered"  # what the last evidence was: heartbeat, cpu, tokens, answer
    cpu: float = 0.0  # the member's CPU seconds at its last heartbeat (0: it reports none)
    cpu_at_progress: float = 0.0  # ... when its last evidence of progress came
    turned_at: float = -1.0  # the last evidence other than CPU time (its event loop turned); -1: progress_at

    def __post_init__(self) -> None:
        if self.turned_at < 0:
            self.turned_at = self.progress_at

    def heartbeat(self, now: float, counter: int, cpu: float = 0.0) -> bool:
        """Records a heartbeat; True when it is evidence of progress: the counter moved since the last
        one, or the member reports none (every heartbeat of such a member counts, as it always did), or
        its CPU time grew as `computing` says work does (kind "cpu")."""
        moved = counter == 0 or counter != self.counter
        if cpu and cpu < self.cpu_at_progress:  # a new beacon: the time its member waited for a CPU counts from its
            self.cpu_at_progress = cpu  # start (rlsync.common.progress.Watched), so from here on, from this report
        worked = cpu - self.cpu_at_progress if cpu and self.cpu_at_progress else 0.0
        busy = computing(worked, now - self.progress_at)
        self.heartbeat_at, self.counter, self.cpu = now, counter, cpu
        if moved or busy:
            self.saw(now, "heartbeat" if moved else "cpu")
        elif not self.cpu_at_progress:
            self.cpu_at_progress = cpu  # its first report: the baseline
        return moved or busy

    def saw(self, now: float, kind: str) -> None:
        self.progress_at, self.kind, self.cpu_at_progress = max(self.progress_at, now), kind, self.cpu
        if kind != "cpu":
            self.turned_at = max(self.turned_at, now)

    def credit(self, seconds: float, now: float) -> None:
        """Time the coordinator itself stood still (stopped, starved, swapped) is not the member's silence:
        whatever it sent meanwhile waits unread."""
        self.progress_at = min(now, self.progress_at + seconds)
        self.heartbeat_at = min(now, self.heartbeat_at + seconds)
        self.turned_at = min(now, self.turned_at + seconds)


@dataclass(frozen=True)
class Verdict:
    action: str  # "" (alive), "suspect" or "drop"
    reason: str = ""  # for metrics: "silent" (nothing heard at all) or "stalled" (heartbeats without progress)
    why: str = ""  # for people


ALIVE = Verdict("")


def judge(evidence: Evidence, now: float, lease: float) -> Verdict:
    """What to do with a member, given its evidence: nothing, suspect it, or drop it. CPU time alone keeps
    it for CPU_ALONE leases at most: a process whose event loop stays stuck while another of its threads
    spins is no less stuck."""
    silent, stuck = now - evidence.progress_at, now - evidence.turned_at
    if stuck / CPU_ALONE > silent:
        silent = stuck / CPU_ALONE
        if silent > lease * SUSPECT_AFTER:
            return Verdict("drop" if silent > lease else "suspect", "stalled",
                           f"it computes, but its event loop has not turned for {stuck:.1f}s (CPU time alone keeps a "
                           f"member {CPU_ALONE} leases)")
    if silent <= lease * SUSPECT_AFTER:
        return ALIVE
    action = "drop" if silent > lease else "suspect"
    if now - evidence.heartbeat_at <= lease * SUSPECT_AFTER:  # its heartbeats come, but show nothing done
        return Verdict(action, "stalled", f"heartbeats arrive but show no progress for {silent:.1f}s (its event loop "
                                          f"has not turned, nor has it used {BUSY_SHARE:.0%} of a core)")
    return Verdict(action, "silent", f"no heartbeat nor any other sign of progress for {silent:.1f}s")


def lateness(now: float, last: float, tick: float) -> float:
    """Seconds the coordinator's own check came late by: its event loop was behind (starved, busy with
    many streams) or the process stood still (stopped, swapped). Whatever members sent meanwhile waited
    unread, so that time is credited to every member (Evidence.credit): the lease runs on the time the
    coordinator could listen."""
    return max(0.0, now - last - tick)
