"""The vLLM engine, driven through AsyncLLM's public API and a registered worker extension (and, for which weight
version made which tokens, its model runner's per-request token counts: vllm_versions)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import vllm
from vllm import SamplingParams as VLLMSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rlsync.checkpoint_names import model_expert_rules
from rlsync.common.timing import Stopwatch
from rlsync.errors import DeadlineExceeded, EngineDead, FailedPrecondition, InvalidArgument, ResourceExhausted
from rlsync.rollout.engines.process import CRASH_DIR_ENV, crash_reports, own_log
from rlsync.rollout.staging import pulled, raise_failure
from rlsync.transfer.handshake import NAMES, PREFERENCE
from rlsync.transfer.checksum import from_sums
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.sharded import layout_of
from rlsync.transfer.v1 import transfer_pb2
from rlsync.common.audit import LIVE
from rlsync.rollout.engines.base import Engine
from rlsync.rollout.engines.checkpoint import checkpoint_checksums, checkpoint_tensors
from rlsync.rollout.engines.fp8_support import checkpoint_format
from rlsync.rollout.engines.vllm_armed import adopted, unlike
from rlsync.rollout.engines.vllm_lora import Adapters
from rlsync.rollout.engines.vllm_trace import mark, trace, trace_path
from rlsync.rollout.engines.vllm_versions import RequestRefused, SwitchPoints, check, owner, pause_scheduler, switch_all
from rlsync.rollout.types import Delta, FinishReason, GenerationRequest, MemoryUsage, PauseMode, WakeTag

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rlsync.rollout.engines.vllm_worker.RlsyncWorkerExtension"
_RPC_PREFIX = "rlsync-vllm-rpc-"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _engine_args(model: str, raw: dict[str, Any]) -> AsyncEngineArgs:
    raw = {"worker_extension_cls": WORKER_EXTENSION, **raw}
    try:
        return AsyncEngineArgs(model=model, **raw)
    except TypeError as e:  # unknown keyword: vLLM's own message names it
        raise InvalidArgument(f"vllm engine argument refused: {e}") from e


class VLLMEngine(Engine):
    kind = "vllm"

    def __init__(self, model: str, engine_args: dict[str, Any]):
        check(vllm.__version__)
        super().__init__(model, engine_args)
        self.args = _engine_args(model, engine_args)
        self.llm: AsyncLLM | None = None
        self._memory = MemoryUsage("", 0, 0, 0)  # read after each operation that changes it
        # Engine processes inherit this and write a report there if a fatal signal kills them.
        self.crash_dir = tempfile.TemporaryDirectory(prefix="rlsync-vllm-crash-")
        os.environ[CRASH_DIR_ENV] = self.crash_dir.name
        # vLLM's sockets between its processes (ipc:// paths), in a folder that goes with this engine: in the
        # temporary folder itself, those of a killed engine process stay there (hundreds a day of tests)
        given = os.environ.get("VLLM_RPC_BASE_PATH", "")  # (the user's, or an earlier engine's of this process)
        self.rpc_dir = None
        if not given or given.startswith(os.path.join(tempfile.gettempdir(), _RPC_PREFIX)):
            self.rpc_dir = tempfile.TemporaryDirectory(prefix=_RPC_PREFIX)
            os.environ["VLLM_RPC_BASE_PATH"] = self.rpc_dir.name
        self.adapters = Adapters(model)
        self._kv_asleep = False  # slept, and the KV cache not woken since: nothing can generate
        self._broken = ""  # why the weights cannot serve: an update written into them failed
        self._pending = False  # an update is prepared (its receive may still be writing)
        self._ended: list[dict] | None = None  # the workers' final states, where the prepare's call ended it
        self._paused = False  # paused by Pause (a commit then leaves it so)
        self._switches: dict[str, SwitchPoints] = {}  # which version made which tokens, per request (vllm_versions)
        self._admit = asyncio.Event()  # cleared while a commit is on its way: new requests wait for it
        self._admit.set()
        self._held: list[bytes] = []  # the storages the worker holds mapped for a trainer (hold_weights)
        self._armed: tuple[transfer_pb2.Offer, transfer_pb2.Answer, dict] | None = None  # armed at a wake
        self._worker_armed = False  # the worker may hold an armed copy: from before rlsync_arm to a disarm's answer
        self._arming = asyncio.Lock()  # arming, withdrawing, holding and releasing, one at a time
        self._rung = 0  # the prepared update is the armed copy, adopted for the offer rung with this bell value
        self._layouts: tuple = (None, None)  # (a routed offer's tensors, each worker's boxes of them: rlsync_layout)

    async def start(self) -> None:
        try:
            self.llm = AsyncLLM.from_engine_args(self.args)
        except (ValueError, TypeError) as e:  # vLLM validates argument values here
            raise InvalidArgument(f"vllm refused its arguments: {e}") from e
        config = self.llm.vllm_config
        tasks = await self.llm.get_supported_tasks()
        if "generate" not in tasks:  # else every Generate fails alike: refuse to start instead
            await self.shutdown()
            raise InvalidArgument(
                f"vllm loaded {self.model} as a model that cannot generate (its tasks: {list(tasks)}; architectures "
                f"{config.model_config.architectures}): its config.json must name a causal LM, e.g. Qwen3ForCausalLM")
        self.tokenizer = self.llm.tokenizer if hasattr(self.llm, "tokenizer") else None
        if self.tokenizer is None:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.max_model_len = config.model_config.max_model_len
        self.dtype = str(config.model_config.dtype).removeprefix("torch.")
        self.vocab_size = config.model_config.get_vocab_size()
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size
        # an FP8 checkpoint's weights stay FP8 in vLLM (its Fp8LinearMethod): updates arrive so, reloaded through
        # vLLM's layerwise reload, which processes them as at the first load
        self.weight_format = checkpoint_format(self.model)
        self.take_stacked(model_expert_rules(self.model))  # (the workers stage each stacked box as one)
        # Each worker counts every request's sampled tokens, so a commit says which ones the old weights made
        # and needs no pause; where one cannot count exactly, each commit pauses generation (vllm_versions)
        why = [w for w in await self.llm.collective_rpc("rlsync_count_tokens") if w]
        self._counted = not why
        if why:
            log.info("commits pause generation between two steps: %s", why[0])
        self.base_version = self.version
        if path := trace_path():  # (a bench's: where a gap in generation comes from)
            await self.llm.collective_rpc("rlsync_trace", args=(path,))
            trace(self.llm.output_processor, "process_outputs", "outputs", path)
        self._in_flight: set[str] = set()
        self._salt = self.version  # moves to the new version before its weights go live
        await self._read_memory()

    async def shutdown(self) -> None:
        self.adapters.close()
        if self.llm is not None:
            with contextlib.suppress(Exception):  # (vLLM's teardown may wait for the whole device)
                await self._disarm()
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)

    def not_ready(self) -> str | None:
        return self._broken or None

    def dead(self) -> str | None:
        if self.llm is None or not self.llm.errored:
            return None
        reports = crash_reports(self.crash_dir.name) or [
            "no engine process reported a fatal signal (killed from outside, e.g. SIGKILL by the OOM killer?)"]
        log_file = own_log()
        return ("vllm engine is dead: " + "; ".join(reports)
                + (f"; the replica's log: {log_file}" if log_file else "") + "; restart the replica")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        p = request.sampling
        params = VLLMSamplingParams(
            n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0),
            max_tokens=p.max_tokens, stop=list(p.stop) or None, seed=p.seed, ignore_eos=p.ignore_eos,
            logprobs=0 if p.logprobs else None, output_kind=RequestOutputKind.DELTA)
        # The salt keeps each version's prefix cache apart: after an in-flight switch, a new request
        # never reuses blocks the old weights computed (requests in flight keep theirs).
        # (None reaches vLLM between the new salt and the commit: it would run a step on the old weights under it)
        await self._admit.wait()
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids), cache_salt=f"rlsync-v{self._salt}")
        self._in_flight.add(request.request_id)
        self._switches[request.request_id] = SwitchPoints(self.base_version, p.n)
        # With an adapter: the request runs on it to the end, so its tokens are all that version's.
        lora, adapter_version = self.adapters.use(request.request_id)
        try:
            # aclosing: a consumer that stops early ends the request in vLLM before its adapter may go
            async with contextlib.aclosing(self.llm.generate(prompt, params, request.request_id,
                                                             lora_request=lora)) as outputs:
                async for out in outputs:
                    for delta in self._deltas(out, p.logprobs, adapter_version, self._switches.get(request.request_id)):
                        yield delta
        except RequestRefused as e:
            raise InvalidArgument(f"vllm refused the request: {e}") from e
        except EngineDeadError as e:
            raise EngineDead(self.dead() or f"vllm engine is dead: {e}") from e
        finally:
            self._in_flight.discard(request.request_id)
            self._switches.pop(request.request_id, None)
            if lora is not None:
                await self.adapters.done(self.llm, request.request_id)

    def _deltas(self, out, want_logprobs: bool, adapter_version: int | None = None,
                switches: SwitchPoints | None = None) -> list[Delta]:
        # Each chunk: the version that made its last token; the final one: the completion's spans, exact to the token.
        version = self.base_version if adapter_version is None else adapter_version
        deltas = []
        for c in out.outputs:
            logprobs = None
            if want_logprobs:
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs or [], c.token_ids)]
            finish = _FINISH.get(c.finish_reason) if c.finish_reason else None
            detail = ""
            if finish is FinishReason.STOP:
                detail = f"stop string {c.stop_reason!r}" if isinstance(c.stop_reason, str) else "end of sequence"
            spans = None
            if adapter_version is None and switches is not None:
                produced = switches.produced.get(c.index, 0) + len(c.token_ids)
                switches.produced[c.index] = produced
                version = switches.version_at(c.index, produced - 1)
                if finish is not None:
                    spans = switches.spans(c.index, produced)
            deltas.append(Delta(c.index, list(c.token_ids), c.text, logprobs, finish, detail, version, spans))
        return deltas

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def pause(self, mode: PauseMode) -> None:
        await self._disarm()  # (vLLM's pause ends in a synchronize of the whole device)
        await pause_scheduler(self.llm, mode.value)
        self._paused = True

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self._paused = False

    async def sleep(self, level: int) -> None:
        # On vLLM's CPU build sleep is a no-op (sleep mode needs CUDA); the core still refuses
        # Generate until WakeUp, so the sequencing is the same everywhere.
        if self._pending:  # its receive may write into memory the sleep unmaps: it ends first
            await self.abort_update()
        await self._disarm()  # (a sleep frees memory, which waits for the whole device)
        # (the last commit's audit may still read the weights; the staging kept for the next update is given back)
        await self.llm.collective_rpc("rlsync_before_sleep")
        await self.llm.sleep(level)
        self._kv_asleep = True
        await self._read_memory()

    async def wake_up(self, tags: frozenset[WakeTag]) -> None:
        if WakeTag.KV_CACHE in tags:  # (its steps would queue behind an armed copy)
            await self._disarm()
        await self.llm.wake_up(sorted(t.value for t in tags))
        if WakeTag.KV_CACHE in tags:
            self._kv_asleep = False
        elif self._held and self._kv_asleep and not self._pending:  # the colocated order: the update these
            await self._arm()  # weights woke for may start on the GPU, when the trainer writes the worker's bell
        await self._read_memory()

    async def _arm(self) -> None:
        """Asks the worker to queue its last pull into the live weights again, behind its bell (rlsync_arm)."""
        async with self._arming:
            self._worker_armed = True  # (from before the call: a call cut short may still have armed)
            try:
                (armed,) = await self.llm.collective_rpc("rlsync_arm")
            except Exception:  # noqa: BLE001 - the update then pulls as it would have without it
                log.warning("could not arm the next update's copy", exc_info=True)
                return
            if "why" in armed:
                self._worker_armed = False  # (it said so)
                log.info("the next update's copy is not armed at this wake: %s", armed["why"])
                return
            self._armed = (transfer_pb2.Offer.FromString(armed["offer"]),
                           transfer_pb2.Answer.FromString(armed["answer"]), armed)

    async def _disarm(self) -> None:
        if self._worker_armed:
            async with self._arming:
                await self._withdraw()

    async def _withdraw(self) -> None:
        """Under `_arming`: withdraws the copy the worker may hold armed (rlsync_disarm); if it wrote the live
        weights (the trainer rang for an offer this replica did not adopt), they are unfit to serve until an
        update lands. The mark is set before the call and taken back only on its answer: a call cut short
        leaves it, and the next withdraws."""
        if not self._worker_armed:
            return
        self._armed, before = None, self._broken
        self._broken = ("weights may be overwritten by the copy armed at the wake, which no update took; the next "
                        "update restores them")
        wrote = any(await self.llm.collective_rpc("rlsync_disarm"))
        self._worker_armed = False
        if not wrote:
            self._broken = before

    def _adopt(self, offer, receiver_id: str, force_backend: str) -> transfer_pb2.Answer | None:
        """The copy armed at the wake as this update, when the offer is the one it repeats (vllm_armed): no call
        into the engine's process. The worker checks at the commit that this offer's bell value started it."""
        if self._armed is None:
            return None
        armed, ans, facts = self._armed
        why = unlike(offer, armed, self._held, force_backend) or ("" if self._kv_asleep else "the KV cache is awake")
        if why:
            log.info("version %d's update is not the copy armed at the wake (%s): pulled as usual",
                     offer.manifest.version, why)
            return None
        self._armed, self._rung, self._pending = None, offer.mapped.bell, True  # (the worker's, until the commit)
        self._broken = (f"weights half-written: version {offer.manifest.version}'s update into them did not "
                        "complete; the next update restores them")
        self._ended = [{"state": "done", "bytes": facts["nbytes"], "memory": None}]
        return adopted(ans, offer.transfer_id, receiver_id, facts["event"])

    async def memory(self) -> MemoryUsage:
        """As of the last operation that changes it (start, sleep, wake-up, an update's steps): asking
        the workers would wait behind the engine's steps, which takes seconds on a busy machine."""
        return self._memory

    async def _read_memory(self) -> None:
        """Best effort: a figure that cannot be read must not fail the operation that changed it."""
        try:
            per_worker = await self.llm.collective_rpc("rlsync_memory")
        except Exception:  # noqa: BLE001 - the previous figures stay
            log.warning("could not read the workers' memory figures", exc_info=True)
            return
        self._take_memory(per_worker)

    def _take_memory(self, per_worker: list[dict]) -> None:
        """The workers' figures (rlsync_memory's, or the commit's answer) as this engine's; None from a worker
        that could not read them (the previous figures stay)."""
        if any(w is None for w in per_worker):
            return
        device = per_worker[0]["device"]
        self._memory = MemoryUsage(device, *(sum(w[k] for w in per_worker) for k in
                                             ("weights_bytes", "kv_cache_bytes", "reserved_bytes", "staging_bytes",
                                              "spare_bytes")))

    # ---- weight updates -------------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], None]]:
        return {n: (shape, None) for n, (shape, _) in checkpoint_tensors(self.model).items()}

    def max_lora_rank(self) -> int | None:
        if not self.args.enable_lora:
            raise FailedPrecondition('this vllm replica takes no LoRA adapters: start it with engine args '
                                     '{"enable_lora": true, "max_lora_rank": R, "max_loras": 2}')
        return self.args.max_lora_rank

    async def prepare_update(self, offer, receiver_id: str, force_backend: str, timeout: float):
        began = time.perf_counter()
        if (adopted := self._adopt(offer, receiver_id, force_backend)) is not None:
            adopted.stages["adopt"] = time.perf_counter() - began
            return adopted
        await self._disarm()  # (before anything else runs in the worker)
        if offer.manifest.HasField("adapter"):  # received here, then loaded by vLLM's own LoRA support
            return await self.adapters.prepare(offer, receiver_id, force_backend, timeout)
        raw = offer.SerializeToString()
        tp = self.tensor_parallel_size
        # Asleep (the colocated order: KV cache still asleep), nothing reads the weights until they are
        # complete: the update lands straight in them where each worker's loaders allow (vllm_direct),
        # with no staging copy beside them; a failure there leaves them unfit to serve until an update lands.
        direct = self._kv_asleep and not offer.HasField("routing")
        self._ended = None
        broken = self._broken
        if direct:  # (from before any rank may write, until the commit)
            self._broken = (f"weights half-written: version {offer.manifest.version}'s update into them did not "
                            "complete; the next update restores them")
        self._pending = True
        # Few calls into the workers: vLLM's engine core serves them only between two steps. One worker
        # answers for itself and begins in the same call, and so do several from a sharded trainer once their boxes
        # are known (each receives only the boxes its loaders keep, found by vLLM's own loaders): where they answer
        # alike; else (and the first time) they agree on one channel first.
        # Each checks the staging's room before it allocates; the memory figures are read once the bytes are in.
        try:
            if tp == 1 and not offer.HasField("routing"):
                needed = sum(t.nbytes for t in offer.manifest.tensors)
                called = time.perf_counter()
                states = await self.llm.collective_rpc("rlsync_begin", args=(
                    raw, b"", timeout, direct, needed, receiver_id, force_backend))
                ans = transfer_pb2.Answer.FromString(states[0].pop("answer"))
                # (the engine core's round trip: the call's time beyond what the worker spent on it)
                ans.stages["rpc"] = max(time.perf_counter() - called - states[0]["in_worker"], 0.0)
            else:
                ans, states = await self._begin_at_once(offer, raw, receiver_id, force_backend, timeout, direct)
                if ans is None:
                    ans, needed = await self._agree(offer, raw, receiver_id, force_backend)
                    states = await self.llm.collective_rpc("rlsync_begin", args=(
                        raw, ans.SerializeToString(), timeout, direct, needed))
        except BaseException:  # refused before any byte moved (a receive's own failure comes back in its state)
            self._broken = broken
            await self.abort_update()
            raise
        if direct and not any(s.get("direct") for s in states):  # every rank staged: the weights are untouched
            self._broken = broken
        if refusals := [s["error"] for s in states if s.get("code") == "ResourceExhausted" and s.get("refused")]:
            await self.abort_update()
            raise ResourceExhausted(refusals[0])
        # a pull ends within this call: finish_update then asks no engine step more for what it knows
        self._ended = states if all(st.get("state") != "running" for st in states) else None
        try:
            return pulled(ans, states)
        except BaseException:
            await self.abort_update()
            raise

    async def _begin_at_once(self, offer, raw: bytes, receiver_id: str, force_backend: str, timeout: float,
                             direct: bool) -> tuple:
        """A routed update whose tensors' boxes the workers gave before (_worker_layouts): each worker answers and
        begins in one call -> (the replica's answer, the workers' states), where they answered alike (one channel,
        one bucket size: the routed groups every worker holds); else the workers' receives are dropped and
        (None, None): the caller agrees on one answer first (_agree)."""
        if not offer.HasField("routing") or self._layouts[0] is not from_proto(offer.manifest):
            return None, None
        states = await self.llm.collective_rpc("rlsync_begin", args=(
            raw, b"", timeout, direct, 0, receiver_id, force_backend, self.tensor_parallel_size, self._layouts[1]))
        answers = [transfer_pb2.Answer.FromString(s.pop("answer")) for s in states]
        if len({(a.backend, a.bucket_bytes, a.pull) for a in answers}) > 1:
            await self.llm.collective_rpc("rlsync_abort")
            return None, None
        ans = answers[0]
        held = set.intersection(*(set(a.groups) for a in answers))  # a routed group only every worker holds
        ans.groups[:] = [g for g in ans.groups if g in held]
        return ans, states

    async def _agree(self, offer, raw: bytes, receiver_id: str, force_backend: str) -> tuple:
        """(the answer every worker of a tensor-parallel replica receives by, the staging bytes each needs)."""
        tp = self.tensor_parallel_size
        layouts = await self._worker_layouts(offer, raw) if offer.HasField("routing") else None
        answers = [transfer_pb2.Answer.FromString(a) for a in await self.llm.collective_rpc(
            "rlsync_answer", args=(raw, receiver_id, tp, force_backend, layouts))]
        if len({a.backend for a in answers}) > 1:  # workers on different GPUs: one channel that suits all
            common = max((a.backend for a in answers), key=PREFERENCE.index)
            answers = [transfer_pb2.Answer.FromString(a) for a in await self.llm.collective_rpc(
                "rlsync_answer", args=(raw, receiver_id, tp, NAMES[common], layouts))]
        ans = answers[0]
        held = set.intersection(*(set(a.groups) for a in answers))  # a routed group only every worker holds
        ans.groups[:] = [g for g in ans.groups if g in held]
        if layouts is not None:
            held = layout_of(from_proto(offer.manifest), ans.layout)
            return ans, max(held.nbytes(r) for r in range(held.ranks))
        return ans, sum(t.nbytes for t in offer.manifest.tensors)

    async def _worker_layouts(self, offer, raw: bytes) -> list[bytes]:
        """Each worker's boxes of a routed offer's tensors (rlsync_layout: what its loaders keep, the same for the
        same tensors at every update), asked once per tensor list: a call less into the workers per update."""
        specs = from_proto(offer.manifest)  # (the same tuple for the same tensors)
        if self._layouts[0] is not specs:
            self._layouts = (specs, await self.llm.collective_rpc("rlsync_layout", args=(raw,)))
        return self._layouts[1]

    async def hold_weights(self, holder: str, handles: list[bytes], facts) -> tuple[int, bytes, str]:
        """The worker keeps a trainer's storages on its GPU mapped between updates (a replica of one worker:
        a trainer's memory lies on one GPU), and answers with its bell (a copy armed at the next wake)."""
        if self.tensor_parallel_size > 1:
            raise FailedPrecondition(f"a vllm replica of {self.tensor_parallel_size} workers maps {holder}'s weights "
                                     "at each update (each worker on its own GPU) and holds nothing between them")
        async with self._arming:  # (not beside an arm: its copy would read what this closes)
            await self._withdraw()
            (held,) = await self.llm.collective_rpc("rlsync_hold", args=(holder, list(handles),
                                                                         facts.SerializeToString()))
            if "refused" in held:
                raise FailedPrecondition(f"cannot hold {holder}'s weights mapped: {held['refused']}")
            self._held = list(handles)
            return held["mapped"], held["bell"], ""

    async def release_weights(self, holder: str) -> int:
        async with self._arming:
            await self._withdraw()
            self._held = []
            return sum(await self.llm.collective_rpc("rlsync_release", args=(holder,)))

    async def finish_update(self, timeout: float) -> float:
        if self.adapters.pending is not None:
            return await self.adapters.finish(self.llm, timeout)
        # Poll instead of one blocking call: a worker blocked in an RPC would stall generation.
        start, states, self._ended = time.perf_counter(), self._ended, None
        polled = states is None
        while True:
            states = states or await self.llm.collective_rpc("rlsync_poll")
            if all(s["state"] != "running" for s in states):
                self._take_memory([s.get("memory") for s in states])  # (a failed transfer has dropped its staging)
                for s in states:
                    raise_failure(s)
                self.received_bytes = tuple(s.get("bytes", 0) for s in states)
                mark("finish_polled" if polled else "finish", start, time.perf_counter())  # (a bench's trace)
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                await self.abort_update()
                raise DeadlineExceeded(f"weight transfer did not finish within {timeout:.0f}s")
            states = None
            await asyncio.sleep(0.005)

    async def commit_update(self, version: int, recompute_kv: bool = False) -> int:
        if self.adapters.pending is not None:  # new requests run on the new adapter; running ones keep theirs
            self._salt = version
            await self.adapters.commit(self.llm, version)
            self.version = version
            return 0
        began, clock = time.perf_counter(), Stopwatch()  # (the stages go back in the commit's answer)
        # The commit is one call into the workers, which vLLM serves between two engine steps: the steps before
        # it ran on the old weights, the steps after it on the new, and the workers' token counts in its answer
        # say which tokens are which. Generation pauses only where the running requests must be prefilled again
        # (recompute_kv: no step may run on the new weights over their old KV first) or a worker cannot count.
        # Paused by Pause, or the KV cache asleep (the colocated order): nothing generates, nothing to freeze.
        pause = not (self._paused or self._kv_asleep) and (recompute_kv or not self._counted)
        if pause:  # freeze requests in place, between two engine steps; they go on after. (The scheduler's own
            # call: AsyncLLM.pause_generation sleeps 20 ms more for the outputs' order, which _produced waits for.)
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        clock.lap("pause")
        try:
            produced = {} if self._counted else await self._produced()  # (counted: in the commit's answer)
            clock.lap("produced")
            # Requests on an adapter would go on with it over the new weights, a mix of versions:
            # they end (the gateway resubmits them), and new ones run on the new weights alone.
            on_adapters = self.adapters.detach()
            try:
                for request_id in on_adapters:  # (vLLM takes them before the commit: one input queue, in order)
                    await self.llm.abort(request_id)
                self._salt = version  # requests arriving from now on run on the new weights
                self._admit.clear()
                rung, self._rung = self._rung, 0
                answers = await self.llm.collective_rpc("rlsync_commit", args=(rung,))
                if rung:
                    self._worker_armed = False  # (the commit took the worker's copy)
                clock.lap("apply")
            except BaseException as e:
                self._admit.set()
                self.adapters.reattach()
                # vLLM's reload wrote into the weights (or they differ from what it was handed): not servable
                self._broken = (f"version {version}'s commit failed after loading into the weights ({e}); the next "
                                "update restores them")
                raise
            self._broken, self._pending = "", False
            if self._counted:
                produced = self._by_request(answers[0]["tokens"])
                ended: dict[str, set[int]] = {}
                for request_id, indices in self._by_request(dict.fromkeys(answers[0]["ended"], 0)).items():
                    ended[request_id] = set(indices)
            switch_all(self._switches, produced, version, ended if self._counted else None)
            self.version = self.base_version = version  # (then the requests waiting: theirs is all the new version)
            self._admit.set()
            await self.adapters.forget(self.llm)
            recomputed = len(self._in_flight) if recompute_kv else 0
            if recompute_kv:  # preempts the running requests: vLLM prefills their tokens again
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            elif not self._in_flight:  # frees the old version's cached blocks now (salts keep them apart anyway)
                await self.llm.reset_prefix_cache()
            clock.lap("bookkeeping")
        finally:
            self._admit.set()  # (whatever failed)
            if pause:
                await self.llm.resume_generation()
            clock.lap("resume")
        for stage, seconds in clock.stages.items():  # (a bench's trace: vllm_trace)
            mark(f"commit_{stage}", began, began := began + seconds)
        self._take_memory([a["memory"] for a in answers])
        self.commit_stages = clock.stages
        return recomputed

    def _by_request(self, tokens: dict[str, int]) -> dict[str, dict[int, int]]:
        """A worker's {vLLM's request id: count} as {request id: {completion index: count}}: by the output
        processor's record while it holds the request, else by the form of vLLM's ids (vllm_versions.owner)."""
        states = self.llm.output_processor.request_states
        completions = {request_id: switches.n for request_id, switches in self._switches.items()}
        out: dict[str, dict[int, int]] = {}
        for vllm_id, count in tokens.items():
            state = states.get(vllm_id)
            ours = (state.external_req_id, state.request_index) if state is not None else owner(vllm_id, completions)
            if ours is not None:
                out.setdefault(ours[0], {})[ours[1]] = count
            else:
                log.debug("a worker counted tokens for %s, which is none of this replica's requests", vllm_id)
        return out

    async def _produced(self) -> dict[str, dict[int, int]]:
        """{request id: {completion index: tokens produced}}, as vLLM's output processor counts them once it
        has taken every output of the steps before the pause (they come before the pause's answer)."""
        queue = getattr(self.llm.engine_core, "outputs_queue", None)
        for _ in range(1000):
            if queue is None or queue.empty():
                break
            await asyncio.sleep(0.001)
        else:
            log.warning("vLLM's outputs before the pause were still queued after 1 s: version spans may be late")
        states = self.llm.output_processor.request_states
        for _ in range(len(states) // 128 + 2):  # it takes a step's outputs in chunks of 128, yielding between
            await asyncio.sleep(0)
        out: dict[str, dict[int, int]] = {}
        for state in list(states.values()):
            out.setdefault(state.external_req_id, {})[state.request_index] = state.detokenizer.num_output_tokens()
        return out

    async def abort_update(self) -> None:
        self._ended, self._rung = None, 0
        await self._disarm()
        await self.adapters.abort(self.llm)
        await self.llm.collective_rpc("rlsync_abort")
        self._pending = False  # (direct, its weights stay marked: written in part, or whole but not committed)
        await self._read_memory()

    async def checksums(self):
        per_worker = await self.llm.collective_rpc("rlsync_applied")
        while any(w is not None and w.get("pending") for w in per_worker):  # read back beside generation
            await asyncio.sleep(0.005)
            per_worker = await self.llm.collective_rpc("rlsync_applied")
        applied = per_worker[0]
        if applied is None:  # still the checkpoint it started from
            base, what = await asyncio.to_thread(checkpoint_checksums, self.model), "checkpoint loaded at start"
        elif "live" in applied:  # landed straight in the live weights, read back from them
            base, what = {n: (d, tuple(s), c) for n, (d, s, c) in applied["live"].items()}, LIVE
        elif "parts" in applied:  # each worker holds its boxes: every tensor's sums are its workers' shares
            base = {}
            for name, (dtype, shape, nbytes, *_) in applied["parts"].items():
                s1 = sum(w["parts"][name][3] for w in per_worker)
                s2 = sum(w["parts"][name][4] for w in per_worker)
                base[name] = (dtype, tuple(shape), from_sums(nbytes, s1, s2))
            what = "tensors applied by the last commit, each worker's boxes summed"
        else:
            base = {n: (d, tuple(s), c) for n, (d, s, c) in applied.items()}
            what = "tensors applied by the last commit"
        if self.adapters.applied:
            return {**base, **self.adapters.applied}, what + ", and the LoRA adapter applied since"
        return base, what

