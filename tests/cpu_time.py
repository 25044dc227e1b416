"""CPU time per test, for balancing `make test`'s lanes: RLSYNC_TEST_CPU=FILE appends one JSON line per test
to FILE, {"test", "wall_s", "cpu_s"}, and the run ends with the tests that took the most CPU.

cpu_s is the whole machine's busy time (/proc/stat) over the test's setup, call and teardown: every
process the test started (replicas, engine workers, trainers) counts, and so does anything else running.
So the figures are the test's own only where its suite runs alone (one lane on an otherwise idle machine);
beside other lanes they measure the machine, not the test."""

from __future__ import annotations

import json
import os
import time

import pytest

_FILE = os.environ.get("RLSYNC_TEST_CPU")
_TICK = os.sysconf("SC_CLK_TCK")
_taken: list[tuple[float, float, str]] = []


def _busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _FILE:
        yield
        return
    wall, cpu = time.monotonic(), _busy_s()
    yield
    wall, cpu = time.monotonic() - wall, _busy_s() - cpu
    _taken.append((cpu, wall, item.nodeid))
    with open(_FILE, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _taken:
        return
    total = sum(c for c, _, _ in _taken)
    terminalreporter.write_sep("=", f"most CPU (the machine's busy seconds; {total:.0f} s over {len(_taken)} tests)")
    for cpu, wall, test in sorted(_taken, reverse=True)[:30]:
        terminalreporter.write_line(f"{cpu:8.1f} s CPU {wall:8.1f} s wall  {test}")
