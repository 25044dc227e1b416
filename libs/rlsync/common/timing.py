"""Timing a sequence of named stages: the phases of a sync, the stages of a transfer."""

from __future__ import annotations

import time


class Stopwatch:
    """Seconds spent in each named stage, in the order they ran."""

    def __init__(self):
        self.stages: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        """Charges the time since the previous lap to `stage`."""
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self._t
        self._t = now

    def add(self, timed_elsewhere: dict[str, float]) -> None:
        """Stages that were timed elsewhere (e.g. the prepare, transfer and commit of a push) and
        take up the time since the previous lap."""
        self.stages.update(timed_elsewhere)
        self._t = time.perf_counter()


def total(stages: dict[str, float]) -> float:
    """The seconds of `stages` in all: a part of a stage, named "stage.part", is within that stage already."""
    return sum(seconds for name, seconds in stages.items() if "." not in name)
