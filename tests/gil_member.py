"""A fleet member that keeps its GIL on command: `python tests/gil_member.py COORDINATOR`.

It registers as a trainer (the coordinator calls a trainer only for a sync or a step, which the test
never asks for) through rlsync's Registrar, prints "registered", then reads commands from stdin, one a
line, and answers each with "done <seconds>":
  busy S  computes for about S seconds in C calls of about 3 s each that never let the GIL go (sums
          over ranges; between two, its event loop may turn);
  idle S  sleeps S seconds in one C call that keeps the GIL (usleep through ctypes.PyDLL).
Its event loop cannot turn during a call, nor could a heartbeat thread of its own."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Iterator

from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER
from rlsync.rpc.registrar import Registrar


CALL = 3.0  # seconds a busy call is sized for: longer than the tests' lease


def busy(seconds: float, call: float = CALL) -> Iterator[None]:
    """Yields after each call; calls sized by the rate the last one ran at (a loaded machine runs them
    slower than any calibration said), growing 8 times at most from one to the next."""
    started, n = time.perf_counter(), 1 << 16
    while (left := seconds - (time.perf_counter() - started)) > 0:
        at = time.perf_counter()
        sum(range(n))
        n = max(1 << 16, min(8 * n, int(n / max(time.perf_counter() - at, 1e-6) * min(call, left))))
        yield


def idle(seconds: float) -> None:
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


async def main(coordinator: str) -> None:
    registrar = Registrar(coordinator, ROLE_TRAINER, "127.0.0.1:9", "gil")
    registrar.start()
    while not registrar.member_id:
        await asyncio.sleep(0.02)
    print("registered", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        what, seconds = line.split()
        started = time.monotonic()
        if what == "busy":
            for _ in busy(float(seconds)):
                await asyncio.sleep(0)  # its event loop turns between two calls
        else:
            idle(float(seconds))
        await asyncio.sleep(0.5)  # its event loop turns again before it answers
        print(f"done {time.monotonic() - started:.2f}", flush=True)
    await registrar.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
