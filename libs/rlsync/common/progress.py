"""This process's progress counter: it moves while the process gets work done (its event loop turns,
transfer bytes land), and heartbeats carry it, so the coordinator tells a busy member from a hung one
(a heartbeat thread can run on while the rest of the process is stuck)."""

from __future__ import annotations


class Progress:
    """A counter that only needs to change while work is done: `advance` from any thread, unlocked (a
    lost increment under a race is harmless; the next one moves it again)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 1  # 0 on the wire means "not reported"

    def advance(self, n: int = 1) -> None:
        self.count += n


PROGRESS = Progress()
