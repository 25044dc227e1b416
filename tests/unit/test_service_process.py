"""ServiceProcess's child setup: the niceness a launcher asks for (fleet members ask for 0, not the 15
of the Ray worker that starts them)."""

from __future__ import annotations

import os
import signal
import sys

from rlsync.launch import ServiceProcess


def niceness_of_child(tmp_path, **kwargs) -> int:
    proc = ServiceProcess("probe", [], log_path=tmp_path / "probe.log",
                          command=[sys.executable, "-c", "import os; print(os.nice(0))"], **kwargs)
    assert proc.proc.wait(60) == 0
    return int(proc.log_path.read_text().split()[-1])


def test_the_child_runs_at_the_niceness_asked_for_and_else_at_its_parents(tmp_path):
    mine = os.nice(0)
    lower = min(mine + 3, 19)  # any process may lower its own priority
    assert niceness_of_child(tmp_path) == mine
    assert niceness_of_child(tmp_path, niceness=lower, parent_death_signal=signal.SIGTERM) == lower
