"""Where a gap in generation comes from: with RLSYNC_STEP_TRACE=path in a vLLM replica's environment, its engine
worker's model steps (execute_model, sample_tokens), its replica's output batches (the output processor), and the
update's own work (finish_update, the commit's stages, the audit thread) each append a line [kind, start, end] to
`path`, in time.perf_counter() seconds (CLOCK_MONOTONIC on Linux: one clock for every process of the host, a
bench's too). For benches only (bench/gpu_cycle.py --trace): a line a step."""

from __future__ import annotations

import functools
import json
import os
import threading
import time

TRACE_ENV = "RLSYNC_STEP_TRACE"


def trace_path() -> str:
    return os.environ.get(TRACE_ENV, "")


@functools.cache
def _writer(path: str):
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life: a line a call
    lock = threading.Lock()

    def write(kind: str, start: float, end: float) -> None:
        with lock:
            out.write(json.dumps([kind, start, end]) + "\n")

    return write


def mark(kind: str, start: float, end: float) -> None:
    """One line [kind, start, end], where tracing is on."""
    if path := trace_path():
        _writer(path)(kind, start, end)


def trace(owner: object, method: str, kind: str, path: str) -> None:
    """Wraps `owner.method` (on the instance) so that each call appends [kind, start, end] to `path`."""
    inner, write = getattr(owner, method), _writer(path)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            write(kind, start, time.perf_counter())

    setattr(owner, method, timed)


def read(path: str) -> list[tuple[str, float, float]]:
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f if line.strip()]
