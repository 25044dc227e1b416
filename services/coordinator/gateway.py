"""The generation gateway: routes each completion to a replica and, when a weight update (or a replica
that dies, or hangs until the registry drops it: its stream then ends with Gone) cuts it short,
resubmits prompt + tokens so far, so the caller sees one continuous stream in which every token
names the weight version that produced it. A suspect replica (no progress for half its lease) gets no
new completions; the ones it streams go on, and every chunk is evidence that keeps it in the fleet."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from rlsync.client import Gone, RpcError
from rlsync.common import metrics
from rlsync.common.v1 import generate_pb2 as pb
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.registry import Member, Registry
from rlsync.coordinator.sync import Syncer
from rlsync.errors import InvalidArgument, NotFound, Relayed, Unavailable

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 16
# Failures of one replica that another replica can make good (anything else is the request's fault).
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}  # an engine's own error: retried a few times only


class Gateway:
    def __init__(self, registry: Registry, syncer: Syncer, cfg: CoordinatorConfig):
        self.registry, self.syncer, self.cfg = registry, syncer, cfg
        self.sessions: dict[str, str] = {}  # session id -> member id
        self.in_flight = 0
        self.resubmissions = 0
        self._aborted: set[str] = set()  # gateway request ids the caller ended
        self._running: dict[str, tuple[Member, str]] = {}  # "request:index" -> (replica, its request id)
        metrics.GATEWAY_IN_FLIGHT.set_function(lambda: self.in_flight)

    # ---- routing --------------------------------------------------------------------------------
    async def _pick(self, session: str, timeout: float = 60.0, avoid: frozenset[str] = frozenset()) -> Member:
        """A ready replica for a completion of `session`: its sticky one, else the least busy; one not in
        `avoid` (ids) while there is such a one."""
        with metrics.GATEWAY_WAITING.track_inprogress():
            return await self._wait_for_replica(session, timeout, avoid)

    def _ready(self, avoid: frozenset[str] = frozenset()) -> list[Member]:
        ready = [m for m in self.registry.rollouts("ready") if not m.suspect]
        return [m for m in ready if m.id not in avoid] or ready

    def _why_none(self) -> str:
        """What the replicas the registry knows are doing, for a request that found none ready."""
        doing = [f"{m.name}: suspect, {m.suspect}" if m.suspect else f"{m.name}: {m.state}"
                 for m in self.registry.rollouts(None)]
        return "; ".join(doing) or "none registered"

    async def _wait_for_replica(self, session: str, timeout: float, avoid: frozenset[str]) -> Member:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            await self.syncer.ready.wait()
            ready = self._ready(avoid)
            sticky = self.registry.members.get(self.sessions.get(session, ""))
            if sticky is not None and sticky in ready:
                return sticky
            if ready:
                member = min(ready, key=lambda m: m.in_flight)
                if session:
                    self.sessions[session] = member.id
                    if len(self.sessions) > 100_000:  # forget the oldest sessions
                        self.sessions.pop(next(iter(self.sessions)))
                return member
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise Unavailable(f"no rollout replica is ready within {timeout:.0f}s ({self._why_none()}): start one "
                                  "(with --coordinator) or wait for it")
            self.registry.changed.clear()
            try:
                await asyncio.wait_for(self.registry.changed.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        base = pb.GenerateRequest()
        base.CopyFrom(request)  # the caller's request is never modified
        if not base.request_id:
            base.request_id = uuid.uuid4().hex
        if base.WhichOneof("prompt") is None:
            raise InvalidArgument("prompt is empty: set GenerateRequest.text or GenerateRequest.token_ids")
        n = base.sampling.n if base.sampling.HasField("n") else 1
        if n <= 0:
            raise InvalidArgument(f"n must be >= 1, got {n}")
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._completion(base, i, n, queue)) for i in range(n)]
        metrics.GATEWAY_REQUESTS.inc()
        self.in_flight += 1
        try:
            finished = 0
            while finished < n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason:
                    finished += 1
                yield item
        finally:
            self.in_flight -= 1
            self._aborted.discard(base.request_id)
            for t in tasks:
                t.cancel()

    def _sub_request(self, base: pb.GenerateRequest, index: int, n: int, attempt: int, prompt: list[int] | None,
                     produced: list[int]) -> pb.GenerateRequest:
        req = pb.GenerateRequest()
        req.CopyFrom(base)
        req.request_id = f"{base.request_id}:{index}:{attempt}"
        req.sampling.n = 1
        if n > 1 and base.sampling.HasField("seed"):
            req.sampling.seed = base.sampling.seed + index  # the n completions must differ
        if produced:  # a resubmission: the prompt so far is the prompt plus what was generated
            req.token_ids.ids[:] = prompt + produced
            req.sampling.max_tokens = _budget(base) - len(produced)
        return req

    async def _completion(self, base: pb.GenerateRequest, index: int, n: int, out: asyncio.Queue) -> None:
        try:
            await self._run_completion(base, index, n, out)
        except RpcError as e:
            out.put_nowait(Relayed(e.code, e.message))
        except Exception as e:  # noqa: BLE001 - delivered to the caller's stream
            out.put_nowait(e)

    async def _run_completion(self, base: pb.GenerateRequest, index: int, n: int, out: asyncio.Queue) -> None:
        key = f"{base.request_id}:{index}"
        prompt: list[int] | None = None
        produced: list[int] = []
        spans: list[pb.VersionSpan] = []
        attempt = 0
        internal = 0  # attempts in a row that a replica failed with an internal error, producing nothing
        faulty: set[str] = set()  # the replicas that did: the next attempts go to others while there are some
        prompt_sent = False  # the caller gets its prompt's ids once, on the first chunk it receives
        while True:
            member = await self._pick(base.session_id, avoid=frozenset(faulty))
            req = self._sub_request(base, index, n, attempt, prompt, produced)
            member.in_flight += 1
            self._running[key] = (member, req.request_id)
            final, start, made = None, len(produced), []  # made: this attempt's spans, from its chunks
            cause = "replica_failed"  # what cut it short, if it is: rlsync_gateway_resubmissions_total{reason}
            # why it was cut short, if it is (the give-up error names the last attempt's)
            last = f"replica {member.name} ended the stream with no final chunk"
            try:
                async for chunk in member.client.stream(req):
                    if prompt is None:
                        prompt = list(chunk.prompt_token_ids)
                    if prompt_sent or start:  # sent already, or a continuation's (prompt + tokens so far)
                        del chunk.prompt_token_ids[:]
                    prompt_sent = prompt_sent or bool(chunk.prompt_token_ids)
                    chunk.request_id, chunk.index = base.request_id, index  # forwarded as is otherwise
                    count = len(chunk.token_ids)
                    if count:
                        _extend(made, chunk.weight_version, len(produced), count)
                        produced += chunk.token_ids
                    if chunk.finish_reason:
                        final = chunk
                    elif count or chunk.text or chunk.prompt_token_ids:
                        out.put_nowait(chunk)
            except RpcError as e:
                fault = e.code in _FAULTS and len(produced) == start
                internal = internal + 1 if fault else 0
                if fault:
                    faulty.add(member.id)
                if e.code not in _RETRYABLE or base.request_id in self._aborted or (
                        internal > self.cfg.max_internal_resubmissions and
                        all(m.id in faulty for m in self._ready())):  # (no replica left that did not fail it)
                    raise
                cause = "replica_lost" if isinstance(e, Gone) else "replica_failed"
                last = f"replica {member.name} answered {e.code.name}: {e.message}"
                log.info("replica %s failed %s (%s); resubmitting", member.name, req.request_id, e.code.name)
                await asyncio.sleep(min(1.0, 0.05 * (attempt + 1)))  # let the registry notice a dead replica
            finally:
                member.in_flight -= 1
                self._running.pop(key, None)
            if final is not None and sum(s.length for s in final.version_spans) == len(produced) - start:
                # The replica's record, exact to the token (when it covers exactly what arrived).
                made = [pb.VersionSpan(weight_version=s.weight_version, start=start + s.start, length=s.length)
                        for s in final.version_spans]
            for s in made:
                _extend(spans, s.weight_version, s.start, s.length)
            if final is not None:
                cut_short = final.finish_reason == pb.FINISH_REASON_ABORT and base.request_id not in self._aborted
                if cut_short and len(produced) >= _budget(base):  # cut at the very end: it is complete
                    final.finish_reason, final.finish_detail, cut_short = pb.FINISH_REASON_LENGTH, "", False
                if not cut_short:
                    self._finish(final, spans, attempt)
                    out.put_nowait(final)
                    return
                cause, last = "aborted", f"replica {member.name} aborted it"
                if final.token_ids or final.text or final.prompt_token_ids:  # what came before the abort counts
                    final.finish_reason, final.finish_detail = 0, ""
                    del final.version_spans[:]
                    out.put_nowait(final)
            attempt += 1
            self.resubmissions += 1
            metrics.RESUBMISSIONS.labels(cause).inc()
            if attempt > self.cfg.max_resubmissions:
                raise Unavailable(f"request {base.request_id} was cut short {attempt} times; giving up (last: {last})")

    def _finish(self, emit: pb.GenerateChunk, spans: list, attempt: int) -> None:
        """Completes the final chunk: spans, versions and resubmissions across every attempt."""
        del emit.version_spans[:]
        emit.version_spans.extend(spans)
        versions = [s.weight_version for s in spans] or [emit.weight_version]
        emit.min_weight_version, emit.max_weight_version = min(versions), max(versions)
        emit.resubmissions = attempt
        bound = self.cfg.max_staleness
        emit.stale = bound >= 0 and self.syncer.trainer_step - emit.min_weight_version > bound
        if emit.stale:
            metrics.STALE_FLAGGED.inc()

    async def abort(self, request_id: str) -> None:
        running = [(k, v) for k, v in self._running.items() if k.rsplit(":", 1)[0] == request_id]
        if not running:
            raise NotFound(f"no gateway request {request_id!r} is in flight")
        self._aborted.add(request_id)
        for _, (member, sub_id) in running:
            try:
                await member.client.abort(sub_id)
            except RpcError:
                pass  # finished meanwhile


def _budget(base: pb.GenerateRequest) -> int:
    return base.sampling.max_tokens if base.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS


def _extend(spans: list[pb.VersionSpan], version: int, start: int, count: int) -> None:
    if spans and spans[-1].weight_version == version:
        spans[-1].length += count
    else:
        spans.append(pb.VersionSpan(weight_version=version, start=start, length=count))
