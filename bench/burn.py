"""Starves the CPU on purpose: N busy-loop processes (plain Python, at the default priority) for as long
as a benchmark or test runs, stopped after. `burning(2 * os.cpu_count())` is a load of 2x the cores.

    python bench/burn.py 8 30     # 8 busy loops for 30 s
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

LOOP = "while True: pass"


def load_of(factor: float) -> int:
    """Busy loops for a load of `factor` times the cores."""
    return round(factor * (os.cpu_count() or 1))


@contextlib.contextmanager
def burning(n: int) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    with burning(int(sys.argv[1])):
        time.sleep(float(sys.argv[2]))
