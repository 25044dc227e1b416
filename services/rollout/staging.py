"""A weight update received in the background into staging tensors, so the engine keeps serving
its current weights until the new ones are complete and verified (used by both engines)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable

import torch

from rlsync.common.aio import resolve
from rlsync.flat import FlatStore
from rlsync.errors import Aborted, DeadlineExceeded, ResourceExhausted, RlsyncError
from rlsync.transfer import Report
from rlsync.transfer.receiver import receiver_for
from rlsync.transfer.v1 import transfer_pb2 as pb


GIB = 1 << 30


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can take: the driver's free memory plus what this
    process's caching allocator holds unused (CUDA), or the host's available memory (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil

    return psutil.virtual_memory().available


def ensure_room(nbytes: int, device: torch.device, version: int) -> None:
    """Refuses an update whose staging copy does not fit, before anything is allocated: staging
    holds one more copy of the weights until the switch (so the engine never serves a half-written
    model). The message says what to change."""
    free = free_bytes(device)
    if nbytes > free:
        raise ResourceExhausted(
            f"staging version {version} needs {nbytes / GIB:.2f} GiB on {device} and {free / GIB:.2f} GiB is free: "
            "an update is received into a second copy of the weights while the first one serves; leave room "
            "for it (vLLM: lower gpu_memory_utilization; hf: fewer max_num_seqs) or use the colocated mode, "
            "which receives in place while the engine sleeps")


class _Workers:
    """Daemon threads that run receives in the background, kept between updates. Starting a thread
    waits until it runs, for the GIL a busy engine's thread holds; an idle worker is handed the job
    through a queue instead, and a thread starts only when none is idle (a receive that hangs
    keeps its own)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that worker's now
        self._jobs.put(job)
        if start:  # (whichever worker takes which job: each job put has a worker of its own)
            threading.Thread(target=self._work, name="rlsync-receive", daemon=True).start()

    def _work(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_WORKERS = _Workers()


class StagedUpdate:
    def __init__(self, offer: pb.Offer, answer: pb.Answer, staging: dict[str, torch.Tensor] | FlatStore, rank: int,
                 device: torch.device, timeout: float, expected=None,
                 base: dict[str, torch.Tensor] | FlatStore | None = None, boxes=None, post: bool = True,
                 hold: str = "", at_once: bool = False):
        """at_once: a routed repeat from held storages may be copied at once and answered as a pull
        (RoutedReceiver's; only where `answer` is the one the caller returns)."""
        self.version = offer.manifest.version
        self.staging = staging
        self.receiver = receiver_for(offer, answer, staging, rank=rank, device=device, timeout=timeout,
                                     expected=expected, base=base, boxes=boxes, post=post, hold=hold, at_once=at_once)
        self.future: concurrent.futures.Future[Report] = concurrent.futures.Future()
        self.started = time.perf_counter()
        # The receiver's setup, timed (its layout, its connection to the sender), for the answer's stages.
        self.stages: dict[str, float] = dict(getattr(self.receiver, "setup", None) or {})
        if answer.pull:  # the bytes are right there to copy: done before the prepare answers
            self._run()
        else:  # the sender starts when it has every answer: receive in the background
            _WORKERS.run(self._run)
            self.stages["spawn"] = time.perf_counter() - self.started

    def _run(self) -> None:
        resolve(self.future, self.receiver.run)

    def poll(self) -> dict:
        """Plain data for callers across a process boundary (vLLM workers)."""
        if not self.future.done():
            return {"state": "running"}
        exc = self.future.exception()
        if exc is None:
            r = self.future.result()
            return {"state": "done", "bytes": r.nbytes, "seconds": r.seconds, "stages": r.profile, "copied": r.copied}
        code = type(exc).__name__ if isinstance(exc, RlsyncError) else "Aborted"
        return {"state": "failed", "code": code, "error": str(exc)}

    def wait(self, timeout: float) -> Report:
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            self.abort()
            raise DeadlineExceeded(f"weight transfer for version {self.version} did not finish within {timeout:.0f}s "
                                   "(is the trainer publishing it?)") from None

    def abort(self) -> None:
        self.receiver.close()
        try:
            self.future.result(5)
        except Exception:  # noqa: BLE001 - it failed because we closed it; that is the point
            pass
        self.staging = {}


class AdoptedUpdate:
    """An update whose bytes one copy already queued moves: a copy armed at the weights' wake, which
    the trainer started on the GPU before its ring arrived (rlsync.transfer.armed), or the last
    pull again, launched as the prepare began (Arming.launch; a sharded trainer's, Arming.launch_routed and
    launch_in_place). The trainer waits for it on `copied`, its CUDA event; `stop` lets it end before its
    memory goes elsewhere; `reads`: what it reads, kept open until the update is dropped (the commit
    synchronizes the device first)."""

    def __init__(self, nbytes: int, copied: bytes, stop: Callable[[], None], version: int, reads=None):
        self.stop, self.version, self.reads = stop, version, reads
        self.report = Report(nbytes, 0.0, {"cuda_ipc": 1}, copied=copied)

    def poll(self) -> dict:
        return {"state": "done", "bytes": self.report.nbytes, "seconds": 0.0, "stages": {},
                "copied": self.report.copied}

    def wait(self, timeout: float) -> Report:
        return self.report  # the commit synchronizes the device before the switch

    def abort(self) -> None:
        self.stop()  # it reads the trainer's memory until done


def pulled(answer: pb.Answer, states: list[dict]) -> pb.Answer:
    """The answer a prepare returns once its ranks began (poll() of each). A pull has ended by
    then, or has its copy queued (the events it names in `copied` follow it): its first failure is
    raised, or its stages (setup, map, copy or queue, release, verify) go into the answer, at the
    slowest rank."""
    if answer.pull:
        for state in states:
            raise_failure(state)
        for state in states:
            for stage, seconds in state["stages"].items():
                answer.stages[stage] = max(answer.stages.get(stage, 0.0), seconds)
            if state.get("copied"):
                answer.copied.append(state["copied"])
    return answer


def raise_failure(state: dict) -> None:
    """Re-raises a failure that poll() reported."""
    from rlsync.transfer.messages import error_from

    if state.get("state") == "failed":
        raise error_from(state.get("code", "Aborted"), state.get("error", "weight transfer failed"))
    if state.get("state") != "done":
        raise Aborted(f"weight transfer is {state.get('state')}")
