"""The reference engine on transformers: batched decoding with a KV cache, abort, pause, real sleep.

One engine thread owns the model and every sequence. Everything that touches them (new requests,
aborts, pause, sleep, wake up, weight swaps) runs as a command on that thread between decode
steps, so no step ever sees a half-changed state. Asyncio callers get results through futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from rlsync.common.aio import resolve
from rlsync.common.audit import LIVE
from rlsync.common.timing import Stopwatch
from rlsync.errors import EngineDead, FailedPrecondition
from rlsync.flat import FlatStore
from rlsync.rollout.detokenize import IncrementalText
from rlsync.rollout.engines.base import Engine
from rlsync.rollout.engines.hf_args import HFEngineArgs
from rlsync.rollout.engines.hf_armed import Arming
from rlsync.rollout.engines.hf_batch import Batch, Sequence
from rlsync.rollout.engines.hf_lora import Adapter
from rlsync.rollout.engines.hf_weights import Weights
from rlsync.rollout.sampling import make_generator, sample
from rlsync.rollout.staging import AdoptedUpdate, StagedUpdate, ensure_room, free_bytes, pulled
from rlsync.transfer import answer
from rlsync.transfer.handshake import local_facts, peer_gpu, same_gpu
from rlsync.transfer.held import HELD
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.sharded import learn
from rlsync.transfer.streams import transfer_stream
from rlsync.rollout.types import (Delta, FinishReason, GenerationRequest, MemoryUsage, PauseMode,
                                  WakeTag)

log = logging.getLogger(__name__)

# Kept free beside the spare weights, besides twice the batch's KV cache (what the cache needs to grow
# by half in rows and columns at once, as steps grow it; many long prompts joining can need more): a
# step's activations and logits, up to max_prefill_tokens x the vocabulary, and what the cache grows
# by between two checks.
SPARE_HEADROOM = 1 << 30
SPARE_CHECK_STEPS = 32


class _Request:
    """The asyncio side of one request: a queue the engine thread fills with Deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()

    def put(self, item: Delta | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class HFEngine(Engine):
    kind = "hf"

    def __init__(self, model: str, engine_args: dict[str, Any]):
        super().__init__(model, engine_args)
        self.args = HFEngineArgs.parse(engine_args)
        self._commands: deque[Callable[[], None]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = False  # the engine thread waits for work (under _cv)
        self._lent = False  # ... and keeps waiting: _soon runs a command in the caller's thread
        self._dead: BaseException | None = None
        self._waiting: deque[tuple[GenerationRequest, _Request]] = deque()
        self._frozen = False  # Pause(KEEP): no step at all
        self._admitting = True  # Pause(ABORT|WAIT): running sequences go on, new ones wait
        self._drained: list[concurrent.futures.Future] = []  # Pause(WAIT) callers
        self._rng = torch.Generator().manual_seed(self.args.seed)
        self.switch_profile: dict[str, dict[str, float]] = {}  # the last sleep's stages (bench/switch.py)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        sys.setswitchinterval(self.args.switch_interval_ms / 1e3)
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        device = self.args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.eos_ids = self._eos_ids(config)
        self.vocab_size = config.vocab_size
        self.max_model_len = self.args.max_model_len or config.max_position_embeddings
        self.weights = Weights.load(self.model, self.device, self.args.dtype)
        self.weight_format = self.weights.format
        self.take_stacked(self.weights.experts)  # (a stacked tensor: the run of its experts' its store holds)
        self.dtype = str(next(iter(self.weights.specs.values()))[1]).removeprefix("torch.")
        self.batch = Batch(self.weights.model, self.device)
        self.adapter = Adapter(self.weights.model, self.device, next(iter(self.weights.specs.values()))[1])
        self._update: tuple | None = None  # (the update, its staging, its adapter or None, its manifest's specs)
        self._layout: tuple[list | None, bool] = (None, False)  # the last manifest's specs: a delta base?
        # pulls queued at wake (rlsync.transfer.armed): touched between steps
        self._arming = Arming(self.device, self.args.arm, self.args.arm_while_generating,
                              self.args.arm_patience_ms / 1e3)
        self._steps_unchecked = 0  # decode steps since the spare's room was last checked
        if self.device.type == "cuda":  # where a sleep makes room for a trainer (on CPU: nothing to hand over)
            local_facts(self.device)  # (and the GPUs it reads by P2P, from NVML: asked now, not at the first update)
            # What is loaded stays: a full collection then walks only what came after (Sleep runs one;
            # over every object of torch and transformers it took 0.24 s on the GPU host, 3 ms after this)
            gc.collect()
            gc.freeze()

    def _eos_ids(self, config: Any) -> set[int]:
        ids = config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        with self._cv:
            self._stopping = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.weights.release()
        if self.device.type == "cuda":
            gc.unfreeze()  # collectable again at exit (nanobind's leak report otherwise lists what was frozen)

    # ---- the engine thread ----------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Runs fn on the engine thread between steps; the returned future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._dead is not None:
                future.set_exception(EngineDead(self.dead()))
            else:  # (a caller that gave up leaves the thread running: resolve)
                self._commands.append(functools.partial(resolve, future, fn))
                self._cv.notify()
        return asyncio.wrap_future(future)

    async def _soon(self, fn: Callable[[], Any]) -> Any:
        """fn between two engine steps: on the engine thread, or, while that thread idles, right here
        with the thread held in its wait (waking it and then this loop again costs more than the few
        ms of copy an update's step runs). Only for steps that never wait on another process: the
        caller's event loop runs them."""
        with self._cv:
            lent = not self._lent and self._idle and not self._commands and self._dead is None and not self._stopping
            if lent:
                self._lent = True
        if not lent:
            return await self._call(fn)
        try:
            return fn()
        finally:
            with self._cv:
                self._lent = False
                self._cv.notify()

    def _has_work(self) -> bool:
        if self._frozen or self.weights.receiving_in_place:  # the latter: requests wait for the commit
            return False
        return bool(self.batch) or (self._admitting and bool(self._waiting))

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._lent or (not self._commands and not self._stopping and not self._has_work()):
                    self._idle = True
                    self._cv.wait()
                self._idle = False
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            watch = self._arming.watch  # (arm_while_generating: what this thread runs is timed, and a step or a
            # command that runs far longer than a step usually does lets a copy armed beside it go)
            for command in commands:
                if watch is not None:
                    watch.began()
                command()
                if watch is not None:
                    watch.ended(step=False)
            if stopping:
                self._abort_all("engine shut down")
                return
            try:
                if self._has_work():
                    if watch is not None:
                        watch.began()
                    self._step()
                    if watch is not None:
                        watch.ended()
            except BaseException as e:  # noqa: BLE001 - a failed step kills the engine, loudly
                log.exception("hf engine step failed; the engine is dead")
                with self._cv:
                    self._dead = e
                self._fail_all(EngineDead(f"hf engine step failed: {e!r}"))
                return

    def _check_spare(self, joining: bool) -> None:
        """Drops the spare weights when the batch may need their memory: room for its cache to grow
        and the headroom must stay free beside them. Checked at every join (prompts, and the step
        that seats a prompt's forked completions) and every SPARE_CHECK_STEPS steps (a device query
        is not free)."""
        self._steps_unchecked += 1
        if self.weights.spare is None and self.weights.armed_spare is None \
                or not (joining or self._steps_unchecked >= SPARE_CHECK_STEPS):
            return
        self._steps_unchecked = 0
        self.weights.yield_spare(free_bytes(self.device), 2 * self.batch.kv_bytes_next() + SPARE_HEADROOM)

    def _step(self) -> None:
        """One forward: a token for every running sequence, and the prompts of waiting requests
        admitted (up to max_prefill_tokens), each whole."""
        self.weights.ensure_restored()
        self._check_spare(joining=bool(self._admitting and self._waiting) or self.batch.outgrown())
        joining, budget, room = [], self.args.max_prefill_tokens, self.args.max_num_seqs - len(self.batch)
        while self._admitting and self._waiting and room > 0 and budget > 0:
            request, sink = self._waiting.popleft()
            budget -= len(request.prompt_token_ids)
            room -= request.sampling.n
            joining.append((request, sink))
        if self.batch or joining:
            running, first = self.batch.step([list(r.prompt_token_ids) for r, _ in joining])
            done = {s for s, row in zip(self.batch.seqs, running) if self._advance(s, row)}
            for i, ((request, sink), row) in enumerate(zip(joining, first)):
                self._admit(request, sink, i, row)
            self.batch.remove(done)
        if not self.batch and self._drained:
            for future in self._drained:
                resolve(future, lambda: None)
            self._drained.clear()

    def _admit(self, request: GenerationRequest, sink: _Request, prompt: int, logits: torch.Tensor) -> None:
        """Starts a prefilled request (the step's prompt number `prompt`): samples each completion's
        first token, and the ones still running join the batch."""
        params = request.sampling
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 62, (1,), generator=self._rng))
        seqs = [Sequence(request.request_id, i, list(request.prompt_token_ids), params,
                         make_generator(self.device, hash((seed, i))), IncrementalText(self.tokenizer, params.stop),
                         sink) for i in range(params.n)]
        self.batch.join(prompt, [s for s in seqs if not self._advance(s, logits)])

    def _advance(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Samples seq's next token from its logits row and emits it; True when seq has finished."""
        token = sample(logits, seq.params, seq.generator)
        logprobs = [float(torch.log_softmax(logits, -1)[token])] if seq.params.logprobs else None
        seq.output.append(token)
        seq.next_token = token
        text = seq.text.add(token)
        finish, detail = None, ""
        if seq.text.stopped_by is not None:
            finish, detail = FinishReason.STOP, f"stop string {seq.text.stopped_by!r}"
        elif token in self.eos_ids and not seq.params.ignore_eos:
            finish, detail = FinishReason.STOP, "end of sequence"
        elif len(seq.output) >= seq.params.max_tokens:
            finish = FinishReason.LENGTH
        if finish is not None:
            text += seq.text.flush()
        seq.sink.put(Delta(seq.index, [token], text, logprobs, finish, detail, self.weights.version))
        return finish is not None

    def _end(self, seqs: list[Sequence], detail: str) -> None:
        for s in seqs:
            s.sink.put(Delta(s.index, [], s.text.flush(), [] if s.params.logprobs else None,
                             FinishReason.ABORT, detail))

    def _abort_where(self, match: Callable[[str], bool], detail: str) -> int:
        """Ends matching requests (running or waiting); returns how many requests ended."""
        running = [s for s in self.batch.seqs if match(s.request_id)]
        self.batch.remove(set(running))
        self._end(running, detail)
        ended = {s.request_id for s in running}
        keep = deque()
        for request, sink in self._waiting:
            if match(request.request_id):
                for i in range(request.sampling.n):
                    sink.put(Delta(i, [], "", None, FinishReason.ABORT, detail))
                ended.add(request.request_id)
            else:
                keep.append((request, sink))
        self._waiting = keep
        return len(ended)

    def _abort_all(self, detail: str) -> int:
        return self._abort_where(lambda _: True, detail)

    def _fail_all(self, exc: BaseException) -> None:
        sinks = {id(s.sink): s.sink for s in self.batch.seqs}
        sinks.update({id(sink): sink for _, sink in self._waiting})
        for sink in sinks.values():
            sink.put(exc)
        for future in self._drained:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # its caller may have given up
                future.set_exception(exc)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        sink = _Request(asyncio.get_running_loop())
        await self._call(lambda: self._waiting.append((request, sink)))
        open_ = request.sampling.n
        while open_:
            item = await sink.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish is not None:
                open_ -= 1
            yield item

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._abort_where(lambda rid: rid == request_id, "aborted"))

    async def pause(self, mode: PauseMode) -> None:
        def apply() -> concurrent.futures.Future | None:
            self._admitting = False
            if mode is PauseMode.KEEP:
                self._frozen = True
            elif mode is PauseMode.ABORT:
                self._abort_where(lambda rid: True, "aborted by Pause(ABORT)")
            elif self.batch:  # WAIT with sequences still running
                drained: concurrent.futures.Future = concurrent.futures.Future()
                self._drained.append(drained)
                return drained
            return None

        drained = await self._call(apply)
        if drained is not None:
            await asyncio.wrap_future(drained)

    async def resume(self) -> None:
        def apply() -> None:
            self._frozen, self._admitting = False, True

        await self._call(apply)

    # ---- memory ---------------------------------------------------------------------------------
    async def sleep(self, level: int) -> None:
        def apply() -> None:
            clock = Stopwatch()
            self._abort_all("aborted by Sleep")
            self.batch.remove(set(self.batch.seqs))
            clock.lap("abort")
            moved = self.weights.sleep(level)
            clock.lap("weights")
            def allocated() -> int:
                return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

            before = allocated()
            gc.collect()  # sequences in cycles hold no GPU memory past this (what _load froze is not walked)
            freed = before - allocated()
            clock.lap("gc")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            clock.lap("empty_cache")
            self.switch_profile["sleep"] = {**clock.stages, "bytes_to_host": moved, "gc_freed_bytes": freed}

        await self._call(apply)

    async def wake_up(self, tags: frozenset[WakeTag]) -> None:
        def wake() -> None:
            self.weights.wake_up()
            if self.device.type == "cuda":
                self._arming.arm(self.weights)  # the update these weights woke for may start on the GPU

        if WakeTag.WEIGHTS in tags:
            await self._call(wake)
            if self.device.type == "cuda":  # made while the offer they woke for is on its way, not waited for
                self._call(self._rearm).add_done_callback(_retrieved)

    def not_ready(self) -> str | None:
        return self.weights.not_ready

    def dead(self) -> str | None:
        return None if self._dead is None else f"hf engine is dead: its step failed with {self._dead!r}"

    async def memory(self) -> MemoryUsage:
        def read() -> MemoryUsage:
            reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
            staging = self._update[1] if self._update is not None else None
            staging_bytes = staging.nbytes() if staging is not None and staging is not self.weights.store else 0
            return MemoryUsage(str(self.device), self.weights.device_bytes(), self.batch.kv_bytes(), reserved,
                               staging_bytes, self.weights.spare_bytes())

        return await self._call(read)

    # ---- weight updates -------------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Any dtype (cast on arrival), except FP8 weights and their scales: those arrive as they are held."""
        held = set(self.weight_format.fp8.weights) if self.weight_format is not None else set()
        return {n: (tuple(shape), dtype if n in held or n.removesuffix("_scale_inv") in held else None)
                for n, (shape, dtype) in self.weights.specs.items()}

    async def prepare_update(self, offer, receiver_id: str, force_backend: str, timeout: float):
        if self.weights.store is None:
            raise FailedPrecondition("weights are asleep: WakeUp(weights) before PrepareUpdate (the update replaces "
                                     "them)")
        clock = Stopwatch()
        lora = offer.manifest.HasField("adapter")  # an adapter for the resident base: it never lands in place
        if lora:  # (its staging and receive run on this side, beside a copy armed into the spare: let it go first)
            self.weights.disarm_spare()
        # The last pull again, into the spare store, before anything else: its copy runs while the
        # answer is made. Not beside a woken engine's pending refill or an armed copy (those go first).
        launched, routed = None, offer.HasField("routing")
        if not lora and self.device.type == "cuda" and not self.weights.pending_restore \
                and self.weights.armed is None:
            specs, version = from_proto(offer.manifest), offer.manifest.version
            # (arm_while_generating: the copy queued into the spare at the last commit, when the trainer's bell
            # for this offer started it; else it runs out, and the spare is free for the launch)
            launched, stage = await self._arming.adopt_spare(self.weights, specs, offer, version), "adopt"
            if launched is None and not routed:
                launched, stage = self._arming.launch(self.weights, specs, offer.mapped, version), "launch"
            elif launched is None and not force_backend:  # a sharded trainer's repeat from storages held here
                try:
                    launched = self._arming.launch_routed(self.weights, specs, offer.routing, version)
                    stage = "launch"
                except Exception as e:  # noqa: BLE001 - (it only saves time) the offer is received as it would be
                    log.warning("could not launch version %d's copy at once: %s", version, e)
            if launched is not None:
                clock.lap(stage)
        try:
            base = None if lora else self._delta_base(offer)
            ans = answer(offer, receiver_id, device=self.device, force=force_backend or None,
                         base_version=None if base is None else self.version)
        except BaseException:
            self._drop_launch(launched)
            raise
        clock.lap("answer")
        if launched is not None and routed:  # (a routed receiver sets it as it arms: copied as it prepares)
            ans.pull = True
        elif launched is not None and not ans.pull:  # (a backend forced otherwise)
            self._drop_launch(launched)
            launched = None

        def receive(staging: FlatStore, post: bool = True) -> StagedUpdate:  # a pull is done (or queued) on return
            # (a sharded trainer's offer may name the holder its pulls stay mapped under: released as any hold)
            return StagedUpdate(offer, ans, staging, 0, self.device, timeout, base=base, post=post,
                                hold=offer.routing.holder, at_once=True)

        def in_place() -> StagedUpdate | AdoptedUpdate | None:
            """Between two steps: a woken engine whose weights are not refilled yet receives right
            into them (the backup still holds the current version): the copy armed at its wake when
            this offer started it (a sharded trainer's too: Arming.arm_routed), a sharded trainer's copy made
            ahead at the wake (launch_in_place), else a pull or a receive."""
            if not self.weights.pending_restore:
                return None
            self.weights.receiving_in_place = True
            try:
                specs = from_proto(offer.manifest)
                if (ans.pull or routed and not force_backend) and (adopted := self._arming.adopt(
                        self.weights, specs, offer, offer.manifest.version)) is not None:
                    clock.lap("adopt")
                    ans.pull = True  # (a routed one: as a routed receiver sets it as it arms)
                    return adopted
                self.weights.disarm()
                if routed and not force_backend and (adopted := self._arming.launch_in_place(
                        self.weights, specs, offer.routing, offer.manifest.version)) is not None:
                    clock.lap("launch")
                    ans.pull = True  # (as a routed receiver sets it as it arms)
                    return adopted
                return receive(self.weights.store, post=False)  # live if this update is abandoned
            except BaseException:
                self.weights.receiving_in_place = False
                raise

        # Only the in-place case touches the engine's state (between two steps: on its thread, or in
        # this one while it idles); otherwise a new store is allocated off the engine thread, so
        # generation goes on.
        try:
            # A pushed receive connects first, which may wait; a routed one meets the trainer's ranks in its run
            # (on a worker), or copies at once from storages held here
            run = self._soon if ans.pull or offer.HasField("routing") else self._call
            update = await run(in_place) if launched is None and self.weights.pending_restore and not lora else None
        except BaseException:  # cancelled too: the engine thread may still receive in place, then this runs
            self._call(self._stop_in_place)
            raise
        staging = self.weights.store
        if launched is not None:
            staging, update = launched
        elif update is None:
            # (an adapter, say) before anything here allocates or frees; woken weights may be armed by a rearm the
            # engine thread has not run yet (Arming.arm_routed): disarmed after it
            if self.weights.armed is not None or self.weights.pending_restore:
                await self._call(self.weights.disarm)
            specs = from_proto(offer.manifest)
            if need := sum(s.nbytes for s in specs) if lora else self.weights.staging_bytes(specs):
                ensure_room(need, self.device, offer.manifest.version)
            clock.lap("room")

            def stage() -> tuple[FlatStore, StagedUpdate]:
                clock.lap("thread")  # (waiting for a worker thread, and for the GIL the engine thread holds)
                # cast on arrival
                staging = self.adapter.staging(specs) if lora else self.weights.staging()
                clock.lap("staging")
                update = receive(staging)
                if not ans.pull:  # (a pull's own stages come with its answer)
                    clock.add(update.stages)  # laid out, connected to the sender, its thread started
                return staging, update

            # One thread hop, not two (a busy replica's GIL); none into the spare store, where nothing is
            # allocated, for what connects to nothing here: a pull on the GPU (the copy is queued, or waits for
            # the trainer's bell) and a routed receiver (it meets the trainer's ranks on a worker of its own).
            # Each hop waits for the GIL decoding holds.
            inline = not need and (ans.pull and self.device.type == "cuda" or offer.HasField("routing"))
            staging, update = stage() if inline else await asyncio.to_thread(stage)
        try:
            pulled(ans, [update.poll()])
        except BaseException:
            await self._call(self._stop_in_place)
            raise
        # A pull from held storages for a waiting sender: the next may repeat it (Arming: one run of one storage;
        # a sharded trainer's routed pull repeats through its kept tables instead)
        if ans.copied and offer.mapped.ipc and not lora and isinstance(update, StagedUpdate):
            self._arming.learn(from_proto(offer.manifest), offer.mapped)
        elif ans.copied and routed and not lora:  # a sharded trainer's: the next copies are made ahead (rearm)
            self._arming.learn_routed(offer, ans)
        ans.stages.update(clock.stages)  # (the hop back from the worker thread is left to the caller's)
        self._update = (update, staging, offer.manifest.adapter if lora else None, from_proto(offer.manifest))
        return ans

    async def hold_weights(self, holder: str, handles: list[bytes], facts) -> tuple[int, bytes, str]:
        peer = same_gpu(facts, self.device) is not None  # on a GPU this one reads by P2P: no bell, nothing armed
        if peer and (why := peer_gpu(facts, self.device)) is not None:
            raise FailedPrecondition(f"cannot hold {holder}'s weights mapped: {why}")

        def hold() -> tuple[int, bytes, str]:
            self.weights.disarm()  # before a storage an armed copy reads may close
            mapped = HELD.hold(holder, handles, self.device)
            if peer:
                self._arming.release(holder)
                return mapped, b"", local_facts(self.device).gpu_uuids[0]
            return mapped, self._arming.hold(holder, handles), ""

        return await self._call(hold)

    async def read_ahead(self, routing) -> bool:
        """Its routed receives copy an offer naming the ranks' memories at once (RoutedReceiver's at_once): what
        they would read first is read now, off the event loop; then what the copy into the store the next offer
        lands in will launch is made, between two steps, not waited for (none while asleep: at the wake, where it
        is armed too: Arming.arm_routed)."""
        memories = tuple(routing.memories)
        await asyncio.to_thread(learn, routing)
        self._call(lambda: self._rearm(memories)).add_done_callback(_retrieved)
        return self._arming.enabled

    def _rearm(self, memories=()) -> bool:
        """(The engine thread.) The launch the next routed offer relaunches, made in the store it will land in: the
        woken weights, else the spare (Arming.rearm)."""
        weights = self.weights
        if weights.armed is not None:  # a copy armed already: the next offer is its
            return self._arming.rearm(None, memories)
        if not weights.pending_restore:
            return self._arming.rearm(weights.spare, memories)
        made = self._arming.rearm(weights.store, memories)
        self._arming.arm_routed(weights)  # then queued behind the bell: the trainer's ring starts it
        return made

    async def release_weights(self, holder: str) -> int:
        def release() -> int:
            self.weights.disarm()
            self._arming.release(holder)
            return HELD.release(holder)

        return await self._call(release)

    def _delta_base(self, offer) -> FlatStore | None:
        """The live weights, as the base a broadcast may send deltas against: when they are the
        manifest's tensors exactly (no cast on arrival) and stay put until the commit (not a
        woken engine about to receive in place)."""
        if self.weights.store is None or self.weights.pending_restore:
            return None
        specs = from_proto(offer.manifest)
        if specs != self._layout[0]:  # the same manifest as last time compares by identity (cached specs)
            self._layout = (specs, self.weights.store.holds(specs))  # (stacked experts too: the same bytes)
        return self.weights.store if self._layout[1] else None

    def _drop_launch(self, launched: tuple[FlatStore, AdoptedUpdate] | None) -> None:
        """A launched pull that will not be committed: its copy ends, then its store is the spare again."""
        if launched is not None:
            staging, update = launched
            update.abort()
            self.weights.give_back_spare(staging)

    def _stop_in_place(self) -> None:
        if self.device.type == "cuda":  # a copy queued into the weights (a prepare given up) ends before a refill
            transfer_stream(self.device).synchronize()
        self.weights.receiving_in_place = False

    async def finish_update(self, timeout: float) -> float:
        update = self._update[0]
        start = time.perf_counter()
        report = await asyncio.to_thread(update.wait, timeout)
        self.received_bytes = (report.nbytes,) if report is not None else ()
        return time.perf_counter() - start

    async def commit_update(self, version: int, recompute_kv: bool = False) -> int:
        _, staging, adapter, specs = self._update
        self._update = None

        def swap() -> int:
            self.weights.disarm()  # an adopted copy: done (the trainer waited for it); never a wait on a bell
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if adapter is not None:
                self.adapter.apply(adapter, staging)
                self.weights.version = version
                return self._recompute(version) if recompute_kv else 0
            self.weights.swap(staging, version, specs)
            self.adapter.disable()
            recomputed = self._recompute(version) if recompute_kv else 0
            self._arming.arm_spare(self.weights)  # (arm_while_generating: the next update's copy, queued)
            return recomputed

        # Between two decode steps: no step sees a mix (a recompute is a prefill: the engine thread's).
        recomputed = await (self._call if recompute_kv else self._soon)(swap)
        self.version = version
        return recomputed

    def _recompute(self, version: int) -> int:
        try:
            return self.batch.recompute()
        except BaseException as e:  # (out of memory, say) a cache half rebuilt: its sequences cannot go on
            self._abort_all(f"rebuilding the KV cache with version {version}'s weights failed: {e!r}")
            raise

    async def abort_update(self) -> None:
        if self._update is not None:
            # (its staging store stays referenced until the abort returns: a copy still writing it has ended)
            (update, _staging, _, _), self._update = self._update, None
            await asyncio.to_thread(update.abort)
        await self._call(self._stop_in_place)  # the backup refills the weights when they are next used

    async def checksums(self):
        return await self._call(lambda: {**self.weights.checksums(), **self.adapter.checksums()}), LIVE


def _retrieved(future: asyncio.Future) -> None:
    """A call left to run on the engine thread unawaited: its failure retrieved (a dead engine's: its next call
    says so), for asyncio, which would warn of one nobody asked for."""
    if not future.cancelled() and (e := future.exception()) is not None and not isinstance(e, EngineDead):
        log.warning("work left to the engine thread failed: %s", e)
