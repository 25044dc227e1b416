"""RLSYNC_TRACE_DIR=<folder>: every transfer end (a sender's send, a receiver's run) writes a PyTorch
profiler trace there, `<what>-<pid>-<ns>.json` (open it in Perfetto): the CPU ops of its thread and
every kernel and copy its process ran meanwhile, an engine's decode on other streams included. For
profiling a transfer among the load it really meets. One trace at a time per process (the profiler
allows one session): an end that overlaps another's is not traced. A traced end costs what the
profiler does: its start, and at its end a synchronize of the whole device. Unset, nothing."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

_ONE = threading.Lock()


@contextmanager
def traced(what: str):
    folder = os.environ.get("RLSYNC_TRACE_DIR")
    if not folder or not _ONE.acquire(blocking=False):
        yield
        return
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            yield
        Path(folder).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(folder) / f"{what}-{os.getpid()}-{time.time_ns()}.json"))
    finally:
        _ONE.release()
