"""This process's progress counter: it moves while the process gets work done (its event loop turns,
transfer bytes land), and heartbeats carry it, so the coordinator tells a busy member from a hung one.
Heartbeats leave from a process of their own (rlsync.rpc.beacon), which runs on while this one is stuck
or busy: once `shared()`, the counter lives in a page of memory that process reads."""

from __future__ import annotations

import mmap
import os


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
