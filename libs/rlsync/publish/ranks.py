"""Runs the coordinator's requests on every rank of a sharded trainer, at the points its loop allows.

Requests reach rank 0 (the one that serves gRPC) at any time; a sharded model's ranks each send their
own shards and add their share to an audit, so every rank must take part. So rank 0 queues each
request, and while the loop sits in `publish()` every rank serves them in step: rank 0 broadcasts
what comes next (an op, a count and a payload as bytes, protobuf or text: no pickle; one collective
when the payload is short), then all ranks run it. A request is a handler every rank runs with the payload (a routed
send, an audit, offload, onload, the memory an offer names, a training step of a sharded trainer), or a
number of passes over a streamed source (see rlsync.transfer.source).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from rlsync.common.stamps import stamp
from rlsync.errors import Unavailable
from rlsync.transfer.source import StreamedSource, run_pass

log = logging.getLogger(__name__)

PASSES, OFFLOAD, ONLOAD, DONE, FAILED, TRAIN, KEEPALIVE, ROUTED, AUDIT, MEMORY = range(10)
DESCRIBE = b"describe"  # ONLOAD's payload when rank 0 is to say where the weights lie (every rank exports)
_MASK = (1 << 64) - 1
# Idle ranks wait in a broadcast, which times out with the process group (gloo: 30 min by
# default): rank 0 says "still here" well before that.
KEEPALIVE_SECONDS = 60.0
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (its name before torch 2.12)
GATHER_FIRST = 1024  # bytes a rank sends in a gather's one all-gather (a longer payload's rest: in a second)
# Bytes of a broadcast's one collective (op, count, length, the payload's first bytes): a routed send's request (the
# offer and the replicas' answers: 20 kB for a mixture of experts' 189 tensors) fits. Between two processes of one
# host a gloo broadcast of 32 kB takes no longer than one of 1 kB (its time is the wake-ups: 0.1-0.2 ms).
BROADCAST_FIRST = 32 << 10
_HEAD = 24  # op, count and the payload's length, int64 each


@dataclass
class Job:
    fn: Callable[[], object]  # rank 0's work
    op: int = PASSES
    # How many passes over the source `fn` makes (the other ranks make as many blind); a callable is
    # asked on rank 0's serving thread, right before the job runs.
    passes: int | Callable[[], int] = 0
    payload: bytes = b""  # what the other ranks' handler for `op` gets
    future: concurrent.futures.Future | None = None


class Ranks:
    """This process's place among the trainer's ranks (one rank when torch.distributed is not set up)."""

    def __init__(self, group=None):
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if on else 0
        self.world = dist.get_world_size(group) if on else 1
        self.src = dist.get_global_rank(group, 0) if on and group is not None else 0
        backend = dist.get_backend(group) if on else "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast(self, op: int, count: int = 0, payload: bytes = b"") -> tuple[int, int, bytes]:
        """Rank 0's op, count and payload on every rank (every rank calls it; only rank 0's arguments count). One
        broadcast of BROADCAST_FIRST bytes (op, count and the payload's length, then its first bytes); a second, of
        the rest, only when the payload is longer: a job's request is one collective, where it was two (a gloo
        collective between two processes of one host: 0.1-0.3 ms)."""
        if self.world == 1:
            return op, count, payload
        first = np.zeros(BROADCAST_FIRST, dtype=np.uint8)
        if self.rank == 0:
            first[:_HEAD] = np.array([op, count, len(payload)], dtype=np.int64).view(np.uint8)
            head = payload[:BROADCAST_FIRST - _HEAD]
            first[_HEAD:_HEAD + len(head)] = np.frombuffer(head, dtype=np.uint8)
        got = self._broadcast(torch.from_numpy(first))
        op, count, size = (int(x) for x in got[:_HEAD].view(np.int64))
        body = got[_HEAD:_HEAD + min(size, BROADCAST_FIRST - _HEAD)].tobytes()
        if size > len(body):
            rest = np.frombuffer(payload[len(body):], dtype=np.uint8).copy() if self.rank == 0 else \
                np.empty(size - len(body), dtype=np.uint8)  # (a writable array: torch takes no read-only one)
            body += self._broadcast(torch.from_numpy(rest)).tobytes()
        return op, count, body

    def _broadcast(self, t: torch.Tensor) -> np.ndarray:
        """Rank 0's `t` (uint8) on every rank, on the CPU."""
        on = t.to(self.device)
        dist.broadcast(on, self.src, group=self.group)
        return on.cpu().numpy()

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order (every rank calls it; each gets them all). One all-gather of
        GATHER_FIRST bytes a rank (its length, then its first bytes); a second, of the longest rest, only when a
        payload is longer."""
        if self.world == 1:
            return [payload]
        first = np.zeros(GATHER_FIRST, dtype=np.uint8)
        first[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        head = payload[:GATHER_FIRST - 8]
        first[8:8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        try:
            every = self._all_gather(torch.from_numpy(first))
            sizes = [int.from_bytes(t[:8].numpy().tobytes(), "little") for t in every]
            out = [t[8:8 + min(n, GATHER_FIRST - 8)].numpy().tobytes() for t, n in zip(every, sizes)]
            longest = max(sizes) - (GATHER_FIRST - 8)
            if longest > 0:
                rest = np.zeros(longest, dtype=np.uint8)
                tail = payload[GATHER_FIRST - 8:]
                rest[:len(tail)] = np.frombuffer(tail, dtype=np.uint8)
                for i, (t, n) in enumerate(zip(self._all_gather(torch.from_numpy(rest)), sizes)):
                    out[i] += t[:max(n - (GATHER_FIRST - 8), 0)].numpy().tobytes()
        except RuntimeError as e:
            raise Unavailable(f"a rank of the trainer is gone (did it die?): {e}") from e
        return out

    def _all_gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `mine`, in rank order, on the CPU: one collective into one tensor, read back once (a read back
        per rank waited for the device once per rank: a describe at every update of a sharded trainer)."""
        every = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=self.device)
        _ALL_GATHER(every, mine.to(self.device), group=self.group)
        return list(every.cpu().view(self.world, -1))

    def add_up(self, values: list[int]) -> list[int]:
        """Every rank's `values` added up, modulo 2^64 (checksum sums; every rank calls it)."""
        if self.world == 1:
            return [v & _MASK for v in values]
        signed = [(v & _MASK) - (1 << 64) if v & _MASK >= 1 << 63 else v & _MASK for v in values]
        t = torch.tensor(signed, dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, group=self.group)  # int64 addition wraps: arithmetic modulo 2^64
        except RuntimeError as e:
            raise Unavailable(f"a rank of the trainer is gone (did it die?): {e}") from e
        return [v & _MASK for v in t.tolist()]

    def max_of(self, t: torch.Tensor) -> torch.Tensor:
        """The elementwise max of every rank's `t` (every rank calls it, with a tensor of the same shape):
        exact in any order, so what the ranks of a sharded weight combine its block scales with."""
        if self.world == 1:
            return t
        out = t.to(self.device)
        try:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise Unavailable(f"a rank of the trainer is gone (did it die?): {e}") from e
        return out

    def agree(self, ok: bool) -> int:
        """How many ranks report a failure (every rank calls it once, with its own outcome)."""
        if self.world == 1:
            return 0 if ok else 1
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(flag, group=self.group)
        except RuntimeError as e:  # a rank is gone
            raise Unavailable(f"a rank of the trainer is gone (did it die?): {e}") from e
        return int(flag.item())


class PublishPoints:
    """Rank 0 queues requests (`submit`, from any thread); every rank serves them inside `serve_until`.

    handlers: what the other ranks run for an op other than PASSES, given rank 0's payload."""

    def __init__(self, ranks: Ranks, source: Callable[[], StreamedSource | object],
                 handlers: dict[int, Callable[[bytes], object]] | None = None):
        self.ranks, self.source = ranks, source
        self.handlers = handlers or {}
        self.jobs: queue.Queue[Job] = queue.Queue()

    def submit(self, fn: Callable[[], object], op: int = PASSES, passes: int | Callable[[], int] = 0,
               payload: bytes = b"") -> concurrent.futures.Future:
        job = Job(fn, op, passes, payload, concurrent.futures.Future())
        self.jobs.put(job)
        return job.future

    def serve_until(self, done: concurrent.futures.Future | None) -> None:
        """Rank 0: serves queued requests until `done` completes, then tells the others (raising its
        error everywhere). Other ranks: mirror rank 0 until it says done."""
        if self.ranks.rank == 0:
            self._lead(done)
        else:
            self._follow()

    def _lead(self, done: concurrent.futures.Future) -> None:
        try:
            idle_since = time.monotonic()
            while True:
                try:
                    job = self.jobs.get(timeout=0.01)
                except queue.Empty:
                    job = None
                if job is None:
                    if done.done():
                        return self._end(done.exception())
                    if time.monotonic() - idle_since > KEEPALIVE_SECONDS:
                        self.ranks.broadcast(KEEPALIVE)
                        idle_since = time.monotonic()
                    continue
                if job.future.set_running_or_notify_cancel():  # its caller may have given up meanwhile
                    self._run(job)
                idle_since = time.monotonic()
        finally:  # nobody serves the queue any more: what waits in it fails instead of hanging
            while not self.jobs.empty():
                job = self.jobs.get_nowait()
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(Unavailable("the trainer's ranks stopped serving requests"))

    def _run(self, job: Job) -> None:
        """Rank 0: one job, with the other ranks in step. Whatever fails is the job's answer, and the
        passes the other ranks are waiting in are finished."""
        source, started, passes = None, 0, 0
        try:
            passes = job.passes() if callable(job.passes) else job.passes
            stamp("job")
            self.ranks.broadcast(job.op, passes, job.payload)
            if passes:  # only a job that walks the source needs it (an offload would build it for nothing)
                source = self.source()
                started = source.passes
            job.future.set_result(job.fn())
        except BaseException as e:  # noqa: BLE001 - handed to the requester
            job.future.set_exception(e)
        finally:
            if source is not None:
                self._finish_passes(source, passes - (source.passes - started))

    def _end(self, error: BaseException | None) -> None:
        """Tells the other ranks the publish is over (and how it failed), then raises its error here."""
        try:
            self.ranks.broadcast(FAILED if error else DONE, payload=str(error or "").encode())
        except Exception:  # a rank is gone: the sync's own error says more, if there is one
            if error is None:
                raise
        if error is not None:
            raise error

    def _follow(self) -> None:
        while True:
            op, count, payload = self.ranks.broadcast(DONE)
            if op == DONE:
                return
            if op == FAILED:
                raise Unavailable(f"rank 0 reports: {payload.decode(errors='replace')}")
            if op == KEEPALIVE:
                continue
            if op != PASSES:
                if self.handlers.get(op) is not None:
                    self.handlers[op](payload)
                continue
            if count:
                source = self.source()
                for _ in range(count):
                    run_pass(source)

    @staticmethod
    def _finish_passes(source, left: int) -> None:
        """A request that failed part way still runs the passes the other ranks are waiting in."""
        for _ in range(max(left, 0)):
            try:
                run_pass(source)
            except Exception:  # noqa: BLE001 - the request's own error is what matters
                log.debug("finishing a pass after a failed request", exc_info=True)
                return
