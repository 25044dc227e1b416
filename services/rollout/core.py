"""The rollout replica's logic: request lifecycle, serving state, weight version tagging. No gRPC here."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
import dataclasses
from dataclasses import dataclass
from typing import Any

from rlsync.checkpoint_names import stacked_specs
from rlsync.common import metrics
from rlsync.common.stamps import profiled
from rlsync.common.timing import total
from rlsync.errors import (AlreadyExists, EngineDead, FailedPrecondition, InvalidArgument, NotFound, RlsyncError,
                           Unavailable)
from rlsync.flat import layout
from rlsync.rollout.engines.base import Engine
from rlsync.rollout.types import (ALL_TAGS, Chunk, FinishReason, GenerationRequest, MemoryUsage,
                                  PauseMode, SamplingParams, WakeTag)
from rlsync import lora
from rlsync.quant.fp8_format import describe, same_format
from rlsync.transfer import check_against, from_proto
from rlsync.transfer.v1.transfer_pb2 import Answer, Offer, Routing

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    request: GenerationRequest
    abort_reason: str | None = None  # set by whoever aborts, shown as the finish detail
    started: bool = False  # the engine has produced output for it


@dataclass(frozen=True)
class Info:
    engine: str
    model: str
    weight_version: int
    state: str  # serving | paused | sleeping | dead
    in_flight: int
    asleep: frozenset[WakeTag]
    max_model_len: int
    tensor_parallel_size: int
    replica_id: str
    vocab_size: int
    memory: MemoryUsage
    pending_version: int
    dtype: str
    dead_reason: str = ""
    requests_admitted: int = 0
    doorbell: str = ""  # where a trainer on this host hands it offers (rlsync.rpc.doorbell)
    received_bytes: tuple[int, ...] = ()  # per engine rank, the last update it waited for
    weight_format: Any = None  # the engine's (rlsync.transfer.v1.WeightFormat), None when unquantized


@dataclass(frozen=True)
class CommitResult:
    version: int
    wait_seconds: float
    switch_seconds: float
    changed: bool
    recomputed: int = 0
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # the engine's own (Engine.commit_stages)


class RolloutCore:
    def __init__(self, engine: Engine, replica_id: str = "", update_timeout: float = 300.0):
        self.engine = engine
        self.update_timeout = update_timeout
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.weight_version = 0
        self.paused = False
        self.asleep: set[WakeTag] = set()
        self.sleep_level = 0
        self.in_flight: dict[str, _InFlight] = {}
        self._control = asyncio.Lock()  # one state change (pause, sleep, update...) at a time
        self.pending: int | None = None  # version of a prepared update not yet committed
        self._pending_full = True  # the prepared update is full weights, not a LoRA adapter
        self.base_version = 0  # the version of the full weights under any adapter (0: the checkpoint)
        self._checked: list | None = None  # the full-weight tensor list last found to fit the model
        self._lora_checked: tuple | None = None  # the adapter manifest last found to fit the base
        self._closed = asyncio.Condition()  # notified whenever a request leaves in_flight
        self.admitted = 0  # Generate requests taken since start
        self._closing: str | None = None
        self.doorbell = ""  # set by the service once its doorbell answers
        metrics.REPLICA_VERSION.set_function(lambda: self.weight_version)
        metrics.REPLICA_IN_FLIGHT.set_function(lambda: len(self.in_flight))

    # ---- requests -------------------------------------------------------------------------------
    def make_request(self, request_id: str, text: str | None, token_ids: list[int] | None,
                     sampling: SamplingParams, chat: list[tuple[str, str]] | None = None) -> GenerationRequest:
        """Validates and tokenizes (a chat: rendered by the model's chat template, with the prompt
        for the assistant's turn); raises InvalidArgument saying what to fix."""
        if token_ids:
            bad = [t for t in token_ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise InvalidArgument(f"token ids {bad[:5]} are outside the vocabulary [0, {self.engine.vocab_size})")
            prompt = tuple(token_ids)
        elif text:
            prompt = tuple(self.engine.tokenizer(text)["input_ids"])
        elif chat:
            prompt = tuple(render_chat(self.engine.tokenizer, chat))
        else:
            raise InvalidArgument("prompt is empty: set GenerateRequest.text, token_ids or chat")
        sampling.check(len(prompt), self.engine.max_model_len)
        return GenerationRequest(request_id or uuid.uuid4().hex, prompt, sampling)

    def _admit(self, request: GenerationRequest) -> _InFlight:
        dead = self.engine.dead()
        if dead:
            raise EngineDead(dead)
        if self._closing:
            raise Unavailable(f"{self._closing}: send the request to another replica")
        if self.asleep:
            tags = ", ".join(sorted(t.value for t in self.asleep))
            raise FailedPrecondition(f"replica is asleep (Sleep level {self.sleep_level} released {tags}): "
                                     "call WakeUp (tags weights and kv_cache, or none for both) before Generate")
        problem = self.engine.not_ready()
        if problem:
            raise FailedPrecondition(problem)
        if request.request_id in self.in_flight:
            raise AlreadyExists(f"request id {request.request_id!r} is already in flight on this replica: "
                                "use a new id, or leave it empty to get one")
        entry = _InFlight(request)
        self.in_flight[request.request_id] = entry
        self.admitted += 1
        metrics.REPLICA_REQUESTS.inc()
        return entry

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Chunk]:
        """Streams the request's chunks, each tagged with the weight version that produced it."""
        entry = self._admit(request)
        spans: dict[int, list[tuple[int, int, int]]] = {}
        produced: dict[int, int] = {}
        open_ = set(range(request.sampling.n))
        try:
            async for d in self.engine.generate(request):
                entry.started = True
                version = d.version if d.version is not None else self.weight_version
                chunk = Chunk(d.index, d.token_ids, d.text, d.logprobs, d.finish, d.detail,
                              request_id=request.request_id, weight_version=version)
                if d.index not in produced:
                    produced[d.index] = 0
                    chunk.prompt_token_ids = list(request.prompt_token_ids)
                if d.token_ids:
                    _extend(spans.setdefault(d.index, []), version, produced[d.index], len(d.token_ids))
                    produced[d.index] += len(d.token_ids)
                    metrics.REPLICA_TOKENS.inc(len(d.token_ids))
                if d.finish is not None:
                    open_.discard(d.index)
                    if d.finish is FinishReason.ABORT:
                        metrics.REPLICA_ABORTED.inc()
                    # The engine's own record when it keeps one (exact to the token), else the chunks'.
                    chunk.version_spans = d.spans if d.spans is not None else spans.get(d.index, [])
                    if d.finish is FinishReason.ABORT and entry.abort_reason:
                        chunk.detail = entry.abort_reason
                yield chunk
        finally:
            del self.in_flight[request.request_id]
            async with self._closed:
                self._closed.notify_all()
            if open_:  # the caller went away (or the engine failed): stop spending compute on it
                await asyncio.shield(self._abort_quietly(request.request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - best effort for a stream nobody reads
            log.debug("abort of abandoned request %s failed", request_id, exc_info=True)

    async def abort(self, request_id: str, reason: str = "aborted by Abort") -> None:
        entry = self.in_flight.get(request_id)
        if entry is None:
            raise NotFound(f"no request {request_id!r} is in flight on this replica (finished already, or never here)")
        entry.abort_reason = entry.abort_reason or reason
        await self.engine.abort(request_id)

    def _mark_all(self, reason: str) -> int:
        for entry in self.in_flight.values():
            entry.abort_reason = entry.abort_reason or reason
        return len(self.in_flight)

    # ---- serving state --------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> tuple[int, int]:
        """Returns (requests aborted, requests still open)."""
        async with self._control:
            aborted = self._mark_all("aborted by Pause(ABORT)") if mode is PauseMode.ABORT else 0
            self.paused = True
            await self.engine.pause(mode)
            if mode is not PauseMode.KEEP:
                # The engine is done with them; wait until their final chunks have gone out too.
                # Requests that arrived while paused have not started and keep waiting for Resume.
                await self._wait_closed(lambda: not any(e.started for e in self.in_flight.values()))
            return aborted, len(self.in_flight)

    async def resume(self) -> None:
        async with self._control:
            await self._resume()

    async def _resume(self) -> bool:
        """Under self._control. True if it was paused."""
        if not self.paused:
            return False
        await self.engine.resume()
        self.paused = False
        return True

    async def sleep(self, level: int) -> int:
        """Returns the number of requests aborted."""
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 (offload weights, drop KV cache) or 2 "
                                  f"(drop both), got {level}")
        async with self._control:
            if self.asleep and self.sleep_level >= level:
                return 0
            self.asleep = set(ALL_TAGS)
            self.sleep_level = level
            aborted = self._mark_all(f"aborted by Sleep(level={level})")
            await self.engine.sleep(level)
            return aborted

    async def wake_up(self, tags: frozenset[WakeTag]) -> None:
        async with self._control:
            await self._wake(tags or ALL_TAGS)

    async def _wake(self, tags: frozenset[WakeTag]) -> frozenset[WakeTag]:
        """Under self._control. Returns what was asleep and is now awake."""
        to_wake = frozenset(tags & self.asleep)
        if to_wake:
            await self.engine.wake_up(to_wake)
            self.asleep -= to_wake
        if not self.asleep:
            self.sleep_level = 0
        return to_wake

    async def info(self) -> Info:
        e = self.engine
        dead = e.dead()
        state = "dead" if dead else "sleeping" if self.asleep else "paused" if self.paused else "serving"
        memory = MemoryUsage("", 0, 0, 0) if dead else await e.memory()
        return Info(e.kind, e.model, self.weight_version, state, len(self.in_flight), frozenset(self.asleep),
                    e.max_model_len, e.tensor_parallel_size, self.replica_id, e.vocab_size, memory,
                    -1 if self.pending is None else self.pending, e.dtype, dead or "", self.admitted, self.doorbell,
                    tuple(e.received_bytes), e.weight_format)

    # ---- weight updates -------------------------------------------------------------------------
    @profiled("prepare")
    async def prepare_update(self, offer: Offer, force_backend: str = "", timeout: float = 0,
                             force: bool = False) -> Answer:
        """Checks the manifest (nothing is written for a bad one), then starts receiving into staging."""
        entered = time.perf_counter()
        async with self._control:
            if self.pending is not None:
                raise FailedPrecondition(f"an update to version {self.pending} is already prepared: CommitUpdate or "
                                         "AbortUpdate it first")
            if WakeTag.WEIGHTS in self.asleep:
                raise FailedPrecondition("weights are asleep: WakeUp(weights) before PrepareUpdate")
            version = offer.manifest.version
            if version < self.weight_version and not force:
                raise FailedPrecondition(f"version {version} is older than the served version {self.weight_version}: "
                                         "set force to roll back")
            start = time.perf_counter()
            specs = from_proto(offer.manifest)
            adapter = offer.manifest.adapter if offer.manifest.HasField("adapter") else None
            if adapter is not None:  # a LoRA adapter for the base this replica holds
                if adapter.base_version != self.base_version:
                    raise FailedPrecondition(
                        f"the LoRA adapter was trained on base version {adapter.base_version}, this replica holds "
                        f"base version {self.base_version} (a full update replaced the checkpoint it started from): "
                        "push the full weights of the adapter's base first, or restart the replica")
                max_rank = self.engine.max_lora_rank()
                checked = (layout(specs), adapter.SerializeToString())  # the same adapter again: known to fit
                if checked != self._lora_checked:
                    lora.check(specs, adapter, self.engine.expected_tensors(), max_rank)
                    self._lora_checked = checked
            elif specs != self._checked:  # the same tensor list as last time compares by identity (cached specs)
                sent = offer.manifest.format if offer.manifest.HasField("format") else None
                if not same_format(sent, self.engine.weight_format):
                    raise InvalidArgument(f"this replica holds its weights as {describe(self.engine.weight_format)}, "
                                          f"the update is {describe(sent)}: offer it with the replica's "
                                          "RolloutInfo.weight_format (OfferWeightsRequest.format)")
                rules = self.engine.stacked_rules  # (stacked experts checked as the checkpoint's tensors they are)
                check_against(stacked_specs(specs, rules).flat if rules else specs, self.engine.expected_tensors())
                self._checked = specs
            checked = time.perf_counter()
            answer = await self.engine.prepare_update(offer, self.replica_id, force_backend,
                                                      timeout or self.update_timeout)
            answer.stages["check"] = checked - start
            # What the prepare took inside this process beyond its named stages: the control lock,
            # hops between threads, bookkeeping (the caller's prepare_rpc is then gRPC alone).
            answer.stages["hops"] = max(time.perf_counter() - entered - total(answer.stages), 0.0)
            self.pending, self._pending_full = version, adapter is None
            return answer

    async def hold_weights(self, holder: str, handles: list[bytes], facts, routing: Routing | None = None
                           ) -> tuple[int, int, bytes, str]:
        """Keeps a process's storages on this GPU (or one it reads by P2P) mapped for the pulls to come ->
        (newly mapped, held, the handle of the engine's bell: HoldWeightsResponse.bell, and .peer_gpu).
        routing: a sharded trainer's memories, for the engine to read ahead of its offers (only saves time:
        a failure is logged)."""
        if not holder:
            raise InvalidArgument("HoldWeights needs a holder (who releases them later)")
        if not handles:
            raise InvalidArgument("HoldWeights needs the storages to map (mapped.ipc): ReleaseWeights lets go")
        mapped, bell, peer_gpu = await self.engine.hold_weights(holder, handles, facts)
        if routing is not None and routing.memories:
            arms = False
            try:
                arms = await self.engine.read_ahead(routing)
            except Exception as e:  # noqa: BLE001 - its offers read what they need then
                log.warning("could not read the trainer's memories ahead of its offers: %s", e)
            bell = bell if arms else b""  # (its offers start no copy armed here)
        return mapped, len(set(handles)), bell, peer_gpu

    async def release_weights(self, holder: str) -> int:
        return await self.engine.release_weights(holder)

    async def commit_update(self, version: int, force: bool = False, timeout: float = 0,
                            recompute_kv: bool = False) -> CommitResult:
        """Waits for the prepared update's bytes, then switches between two engine steps; requests in
        flight go on (on a KV cache rebuilt with the new weights when `recompute_kv`). A failure
        leaves the served version."""
        async with self._control:
            if self.pending is None:
                if version == self.weight_version:
                    return CommitResult(version, 0.0, 0.0, False)  # idempotent
                raise FailedPrecondition(f"no update is prepared: PrepareUpdate (and have the trainer publish "
                                         f"version {version}) before CommitUpdate")
            if version != self.pending:
                raise InvalidArgument(f"CommitUpdate({version}), but the prepared update is version {self.pending}")
            if version < self.weight_version and not force:
                await self._drop_pending()
                raise FailedPrecondition(f"version {version} is older than the served version {self.weight_version}; "
                                         "the prepared update was dropped (set force to roll back)")
            try:
                waited = await self.engine.finish_update(timeout or self.update_timeout)
            except RlsyncError as e:
                await self._drop_pending()
                raise type(e)(f"update to version {version} failed, still serving version {self.weight_version}: "
                              f"{e}") from e
            start = asyncio.get_running_loop().time()
            try:
                recomputed = await self.engine.commit_update(version, recompute_kv)
            except BaseException:
                await self._drop_pending()
                raise
            self.weight_version, self.pending = version, None
            if self._pending_full:  # the base is now these weights (an adapter leaves it as it was)
                self.base_version = version
            return CommitResult(version, waited, asyncio.get_running_loop().time() - start, True, recomputed,
                                dict(self.engine.commit_stages))

    async def abort_update(self) -> bool:
        async with self._control:
            had = self.pending is not None
            await self._drop_pending()
            return had

    async def _drop_pending(self) -> None:
        self.pending = None
        try:
            await self.engine.abort_update()
        except Exception:  # noqa: BLE001 - the staging memory goes either way
            log.warning("dropping the prepared update failed", exc_info=True)

    async def release_control(self, why: str, still: Callable[[], bool] = lambda: True) -> list[str]:
        """Undoes what a controller that vanished left behind: drops a prepared update, wakes the
        engine, resumes generation, serving the weights it fully has. Returns what it did. `still`
        is asked again once no other state change runs (the controller may be back by then)."""
        async with self._control:
            if not still():
                return []
            done = []
            if self.pending is not None:
                done.append(f"dropped the prepared update to version {self.pending}")
                await self._drop_pending()
            if woken := await self._wake(ALL_TAGS):
                done.append(f"woke up ({', '.join(sorted(t.value for t in woken))})")
            if await self._resume():
                done.append("resumed")
            if done:
                log.warning("%s: %s; serving version %d", why, ", ".join(done), self.weight_version)
            return done

    async def checksums(self) -> tuple[int, dict, str]:
        sums, source = await self.engine.checksums()
        return self.weight_version, sums, source

    async def _wait_closed(self, done, timeout: float = 10.0, warn: bool = True) -> None:
        """Waits until `done()` holds (re-checked as requests close), for at most `timeout` seconds;
        a client that stops reading its stream must not hold the replica hostage."""
        async with self._closed:
            try:
                await asyncio.wait_for(self._closed.wait_for(done), timeout)
            except TimeoutError:
                if warn:
                    log.warning("streams still open after %.0fs: %s", timeout, sorted(self.in_flight))

    async def drain(self, reason: str, finish_within: float = 0.0, timeout: float = 10.0) -> None:
        """Refuses new requests, gives those in flight up to `finish_within` seconds to complete, ends
        the rest with `reason` (the gateway resumes them elsewhere) and waits (bounded) for their
        streams to close."""
        self._closing = reason
        if finish_within > 0 and not self.paused:
            await self._wait_closed(lambda: not self.in_flight, finish_within, warn=False)
        for request_id in list(self.in_flight):
            try:
                await self.abort(request_id, reason)
            except NotFound:
                pass
        if self.paused:  # frozen streams must run to deliver their final chunk
            await self.engine.resume()
        await self._wait_closed(lambda: not self.in_flight, timeout)


def render_chat(tokenizer, chat: list[tuple[str, str]]) -> list[int]:
    """The token ids of a conversation under the tokenizer's chat template, ending with the
    generation prompt (the template adds any special tokens it wants; nothing else is added)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("this model's tokenizer has no chat template: send a text or token-id prompt "
                              "(/v1/completions) instead of messages")
    try:
        text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in chat], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template refuses what it cannot render (jinja raises)
        raise InvalidArgument(f"the chat template refused these messages: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _extend(spans: list[tuple[int, int, int]], version: int, start: int, count: int) -> None:
    """Appends `count` tokens made by `version` to a completion's version spans."""
    if spans and spans[-1][0] == version:
        v, s, n = spans[-1]
        spans[-1] = (v, s, n + count)
    else:
        spans.append((version, start, count))
