"""The SGLang engine, driven only through SGLang's public interfaces: its Engine (the tokenizer
manager's requests on the replica's own event loop) and its custom weight loader hook.

Updates are received in this process, over rlsync's own channels, into staging memory another
process can map (memfd), while the engine serves the weights it has; the commit pauses the engine
between two batches and hands the scheduler a request naming that memory (sglang_scheduler.py),
which maps it and loads it with the model's own load_weights. No tensor is pickled: SGLang's call
carries one empty tensor and a name. Each commit starts a new cache salt, so that no request admitted after it
reuses prefix KV that the old weights computed.

On CPU: SGLang's kernels (sgl_kernel) are built for CUDA and are called only on processors with AMX;
the replica's environment has a placeholder sgl_kernel (deploy/sglang-cpu), which registers no torch
operator, so SGLang takes its non-AMX path on every processor. Sleep releases nothing on CPU (SGLang
frees memory only with its CUDA memory saver); LoRA adapters are refused; a request's seed is passed
on, but SGLang applies seeds only with enable_deterministic_inference, which its CPU attention backend
(torch_native) does not support, so seeded samples do not repeat there.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import torch

from rlsync.checkpoint_names import model_expert_rules, stacked_specs
from rlsync.errors import Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument
from rlsync.rollout.engines.base import Engine
from rlsync.rollout.engines.checkpoint import ITEMSIZE, checkpoint_checksums, checkpoint_tensors
from rlsync.rollout.engines.sglang_scheduler import LOADER, PREFIX, Reply, Request
from rlsync.rollout.engines.sglang_staging import SharedStaging
from rlsync.rollout.staging import StagedUpdate, ensure_room, pulled, raise_failure
from rlsync.rollout.types import Delta, FinishReason, GenerationRequest, MemoryUsage, PauseMode, WakeTag
from rlsync.transfer import answer
from rlsync.transfer.manifest import from_proto

if importlib.util.find_spec("sglang") is None:  # the registry says what to install
    raise ImportError("No module named 'sglang' in this environment")

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# What the replica sets unless its engine args say otherwise: CPU, no CUDA graphs, deltas while streaming.
# SGLang sizes its KV pool as the memory free after loading the weights less (1 - mem_fraction_static) of
# what was free before: on a host where other processes allocate meanwhile, a small fraction leaves nothing
# and the replica refuses to start. So a quarter of the free memory may go while it loads, and the pool
# is capped at a fixed size instead (max_total_tokens).
# sleep_on_idle: SGLang's scheduler otherwise polls its sockets in a loop while it has no request, a whole core
# per replica (measured on CPU: 1.01 CPU-s per second idle, 0.017 with it), taken from the trainer beside it
# through every training step; it sleeps in zmq's poll on the same sockets instead, so a request still wakes
# it at once.
_DEFAULTS = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
             "mem_fraction_static": 0.25, "max_total_tokens": 32768, "log_level": "warning", "sleep_on_idle": True}


class SGLangEngine(Engine):
    kind = "sglang"

    def __init__(self, model: str, engine_args: dict[str, Any]):
        super().__init__(model, engine_args)
        if "custom_weight_loader" in engine_args:
            raise InvalidArgument("custom_weight_loader is rlsync's own on an sglang replica (it loads updates "
                                  "through it): leave it out of the engine args")
        self.args = {**_DEFAULTS, **engine_args, "incremental_streaming_output": True,
                     "custom_weight_loader": [LOADER]}
        self.device = torch.device("cuda" if self.args["device"] == "cuda" else "cpu")
        ranks = {k: self.args[k] for k in ("tp_size", "dp_size", "pp_size") if self.args.get(k) not in (None, 1)}
        if self.args["device"] == "cpu" and ranks:
            raise InvalidArgument(
                f"an sglang replica on CPU runs one rank ({', '.join(f'{k}={v}' for k, v in ranks.items())} asked): "
                "SGLang's CPU all-reduce comes only with its AMX kernels (sgl_kernel's CPU build), and this "
                "environment has a placeholder sgl_kernel (deploy/sglang-cpu); use tp_size 1, a GPU, or a vllm "
                "replica for tensor parallel on CPU")
        self.engine = None
        self._rids: dict[str, list[str]] = {}  # request id -> its SGLang rids (one per completion)
        self._paused = False
        # SGLang's radix cache keeps a prompt's KV across weight updates (a commit flushes nothing: SGLang refuses
        # a flush while requests run), and would serve a repeated prompt's prefix as the old weights computed it.
        # Requests name the commit they arrived after as their cache_salt (SGLang's namespace for prefixes), as a
        # vllm replica's do; the old commits' entries are left to SGLang's LRU eviction.
        self._salt = 0
        self._update: StagedUpdate | None = None
        self._applied: dict | None = None
        self._stack: tuple = ((), None)  # a manifest's specs, its stacked experts (from_proto's tuple: by identity)
        self._replies = tempfile.TemporaryDirectory(prefix="rlsync-sglang-")

    async def start(self) -> None:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1" if self.device.type == "cpu" else "0")
        os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # logprobs of the model, not of the sampler
        import sglang

        try:
            self.engine = sglang.Engine(model_path=self.model, **self.args)
        except TypeError as e:  # an unknown keyword: SGLang's own message names it
            raise InvalidArgument(f"sglang engine argument refused: {e}") from e
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        config = AutoConfig.from_pretrained(self.model)
        manager = self.engine.tokenizer_manager
        self.max_model_len = int(getattr(manager, "context_len", 0) or config.max_position_embeddings)
        self.vocab_size = config.vocab_size
        self.dtype = str(getattr(getattr(manager, "model_config", None), "dtype", self.args.get("dtype", "auto")))
        self.dtype = self.dtype.removeprefix("torch.")
        self.take_stacked(model_expert_rules(self.model))  # (its scheduler loads each stacked tensor's experts)
        await self._set_version(self.version)

    async def shutdown(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.shutdown)
        self._replies.cleanup()

    # ---- generation ------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        p = request.sampling
        params = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
                  "top_k": p.top_k if p.top_k > 0 else -1, "stop": list(p.stop) or None, "ignore_eos": p.ignore_eos}
        prefix, salt = uuid.uuid4().hex, f"rlsync-{self._salt}"  # (one salt: the completions share the prompt's KV)
        self._rids[request.request_id] = [f"{prefix}-{i}" for i in range(p.n)]
        queue: asyncio.Queue = asyncio.Queue()

        async def one(index: int) -> None:
            seeded = {**params, "sampling_seed": p.seed + index} if p.seed is not None else params
            try:
                stream = await self.engine.async_generate(
                    input_ids=list(request.prompt_token_ids), sampling_params=seeded, stream=True,
                    return_logprob=p.logprobs, rid=f"{prefix}-{index}", cache_salt=salt)
                async with contextlib.aclosing(stream):
                    async for chunk in stream:
                        await queue.put(self._delta(index, chunk, p.logprobs))
            except ValueError as e:  # SGLang validates requests with ValueError
                await queue.put(InvalidArgument(f"sglang refused the request: {e}"))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(one(i)) for i in range(p.n)]
        try:
            open_ = p.n
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            self._rids.pop(request.request_id, None)

    def _delta(self, index: int, chunk: dict, want_logprobs: bool) -> Delta:
        meta = chunk["meta_info"]
        finish = meta.get("finish_reason")
        reason = _FINISH.get(finish["type"]) if finish else None
        detail = ""
        if reason is FinishReason.STOP:
            matched = finish.get("matched")
            detail = f"stop string {matched!r}" if isinstance(matched, str) else "end of sequence"
        logprobs = [float(lp) for lp, _, _ in meta.get("output_token_logprobs") or []] if want_logprobs else None
        version = meta.get("weight_version")
        version = int(version) if isinstance(version, str) and version.isdigit() else self.version
        return Delta(index, list(chunk.get("output_ids") or []), chunk.get("text", ""), logprobs, reason, detail,
                     version, _spans(meta.get("weight_versions")) if reason is not None else None)

    async def abort(self, request_id: str) -> None:
        for rid in self._rids.get(request_id, ()):
            self.engine.tokenizer_manager.abort_request(rid)

    async def pause(self, mode: PauseMode) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if mode is PauseMode.WAIT:  # SGLang has no such mode: let what runs finish, then freeze
            while self._rids:
                await asyncio.sleep(0.01)
        if mode is PauseMode.ABORT and self._paused:  # frozen requests end only once the scheduler runs again
            await self.resume()
        await self.engine.tokenizer_manager.pause_generation(
            PauseGenerationReqInput(mode="abort" if mode is PauseMode.ABORT else "in_place"))
        self._paused = True

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False))
        self._paused = False

    async def sleep(self, level: int) -> None:
        log.info("sleep(%d): SGLang releases memory only with its CUDA memory saver; on this replica nothing is "
                 "released, and Generate waits for WakeUp as on any engine", level)

    async def wake_up(self, tags: frozenset[WakeTag]) -> None:
        pass

    async def memory(self) -> MemoryUsage:
        """The checkpoint's bytes (SGLang does not say what its scheduler holds), and the staging of
        an update being received."""
        checkpoint = checkpoint_tensors(self.model).values()
        weights = sum(math.prod(shape) * ITEMSIZE.get(dtype, 4) for shape, dtype in checkpoint)
        staging = self._update.staging.nbytes() if self._update is not None else 0
        return MemoryUsage(str(self.device), weights, 0, 0, staging)

    # ---- weight updates --------------------------------------------------------------------------
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], None]]:
        return {n: (shape, None) for n, (shape, _) in checkpoint_tensors(self.model).items()}

    def max_lora_rank(self) -> int | None:
        raise FailedPrecondition("this sglang replica takes no LoRA adapters: SGLang's LoRA layers need pinned "
                                 "memory (a GPU) and dynamic adapters need enable_lora at start; publish full "
                                 "weights, or use a vllm or hf replica for LoRA")

    async def prepare_update(self, offer, receiver_id: str, force_backend: str, timeout: float):
        if offer.manifest.HasField("adapter"):
            self.max_lora_rank()
        specs = from_proto(offer.manifest)
        needed = sum(s.nbytes for s in specs)
        ensure_room(needed, self.device, offer.manifest.version)
        if self._stack[0] is not specs:  # (the same tensors again: no per-tensor work per update)
            self._stack = (specs, stacked_specs(specs, self.stacked_rules))
        staging = SharedStaging(specs, self._stack[1])
        ans = answer(offer, receiver_id, device=self.device, force=force_backend or None)
        self._update = StagedUpdate(offer, ans, staging.store, 0, self.device, timeout)
        self._update.staging = staging
        try:
            return pulled(ans, [self._update.poll()])
        except BaseException:
            await self.abort_update()
            raise

    async def finish_update(self, timeout: float) -> float:
        update = self._update
        if update is None:
            raise FailedPrecondition("no update is prepared")
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            report = await asyncio.to_thread(update.wait, timeout)
        except DeadlineExceeded:
            self._update = None
            raise
        raise_failure(update.poll())
        self.received_bytes = (report.nbytes,)
        return loop.time() - start

    async def commit_update(self, version: int, recompute_kv: bool = False) -> int:
        from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                                   UpdateWeightsFromTensorReqInput)
        from sglang.srt.utils import MultiprocessingSerializer

        update, self._update = self._update, None
        if update is None:
            raise FailedPrecondition("no update is prepared")
        staging: SharedStaging = update.staging
        reply = os.path.join(self._replies.name, uuid.uuid4().hex)
        request = Request(reply=reply, pid=os.getpid(), fd=staging.fd, nbytes=staging.nbytes(),
                          tensors=staging.tensors, audited=staging.audited)
        named = [(PREFIX + msgspec.json.encode(request).decode(), torch.empty(0))]
        manager = self.engine.tokenizer_manager
        was_paused = self._paused
        if not was_paused:  # between two batches: requests in flight keep their place (and their KV unless recomputed)
            from sglang.srt.managers.io_struct import PauseGenerationReqInput

            await manager.pause_generation(PauseGenerationReqInput(mode="retract" if recompute_kv else "in_place"))
        # Nothing runs until the resume: requests from now on wait, then prefill on the new weights under a new salt.
        # (Per attempt, not per version: a failed commit's version may come again, after requests ran on the old.)
        self._salt += 1
        recomputed = len(self._rids) if recompute_kv else 0
        try:
            await _ok(manager.begin_weight_update(BeginWeightUpdateReqInput(selector="all"), None), "begin")
            try:
                await _ok(manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[MultiprocessingSerializer.serialize(named)], load_format=LOADER,
                    flush_cache=recompute_kv), None), "load")
            finally:
                await _ok(manager.end_weight_update(EndWeightUpdateReqInput(), None), "end")
            result = msgspec.json.decode(Path(reply + ".0").read_bytes(), type=Reply)
            if not result.ok:
                raise Aborted(f"the sglang scheduler could not load version {version}: {result.error}")
            self._applied = {n: (d, tuple(s), c) for n, (d, s, c) in result.applied.items()}
            await self._set_version(version)
        finally:
            staging.close()
            if not was_paused:
                await self.resume()
        return recomputed

    async def abort_update(self) -> None:
        update, self._update = self._update, None
        if update is not None:
            await asyncio.to_thread(update.abort)
            update.staging.close()

    async def checksums(self):
        if self._applied is None:
            return await asyncio.to_thread(checkpoint_checksums, self.model), "checkpoint loaded at start"
        return dict(self._applied), "tensors the scheduler loaded at the last commit"

    async def _set_version(self, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        await self.engine.tokenizer_manager.update_weight_version(
            UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False))
        self.version = version


def _spans(recorded) -> list[tuple[int, int, int]] | None:
    """The scheduler's record of which weight version made which of a completion's tokens
    (meta_info["weight_versions"]: version, start, end), as (version, start, length); None where it
    keeps none. A chunk carries one version (its last token's); this record says which version made
    each token, a chunk that straddles a commit included."""
    if not recorded:
        return None
    try:
        spans = [(int(s["version"]), int(s["start"]), int(s["end"]) - int(s["start"])) for s in recorded]
    except (KeyError, TypeError, ValueError):  # a version that is not ours (set by hand): not a record to trust
        return None
    return [s for s in spans if s[2] > 0] or None


async def _ok(call, what: str) -> None:
    result = await call
    success, message = (result[0], result[1]) if isinstance(result, tuple) else (result.success, result.message)
    if not success:
        raise Aborted(f"sglang refused the weight update ({what}): {message}")
