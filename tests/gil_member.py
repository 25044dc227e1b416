"""A fleet member that keeps its GIL on command: `python tests/gil_member.py COORDINATOR`.

It registers as a trainer (the coordinator calls a trainer only for a sync or a step, which the test
never asks for) through rlsync's Registrar, prints "registered", then reads commands from stdin, one a
line, and answers each with "done <seconds>":
  busy S  computes for S seconds in one C call that never lets the GIL go (sum over a range);
  idle S  sleeps S seconds in one C call that keeps the GIL (usleep through ctypes.PyDLL).
Its event loop cannot turn meanwhile, nor could a heartbeat thread of its own."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time

from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER
from rlsync.rpc.registrar import Registrar


def busy(seconds: float) -> None:
    started, n = time.perf_counter(), 1 << 16
    while time.perf_counter() - started < seconds / 8:  # calibrate on an eighth of it, then one call
        sum(range(n))
        n *= 2
    sum(range(int(n * seconds / max(time.perf_counter() - started, 1e-3))))


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
        {"busy": busy, "idle": idle}[what](float(seconds))
        await asyncio.sleep(0.5)  # its event loop turns again before it answers
        print(f"done {time.monotonic() - started:.2f}", flush=True)
    await registrar.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
