"""The vLLM engine, driven only through AsyncLLM's public API and a registered worker extension."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm import SamplingParams as VLLMSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from rlsync.errors import EngineDead, InvalidArgument
from rlsync.rollout.engines.base import Engine
from rlsync.rollout.types import Delta, FinishReason, GenerationRequest, MemoryUsage, PauseMode, WakeTag

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rlsync.rollout.engines.vllm_worker.RlsyncWorkerExtension"
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
        super().__init__(model, engine_args)
        self.args = _engine_args(model, engine_args)
        self.llm: AsyncLLM | None = None

    async def start(self) -> None:
        try:
            self.llm = AsyncLLM.from_engine_args(self.args)
        except (ValueError, TypeError) as e:  # vLLM validates argument values here
            raise InvalidArgument(f"vllm refused its arguments: {e}") from e
        config = self.llm.vllm_config
        self.tokenizer = self.llm.tokenizer if hasattr(self.llm, "tokenizer") else None
        if self.tokenizer is None:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.get_vocab_size()
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size

    async def shutdown(self) -> None:
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        p = request.sampling
        params = VLLMSamplingParams(
            n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0),
            max_tokens=p.max_tokens, stop=list(p.stop) or None, seed=p.seed, ignore_eos=p.ignore_eos,
            logprobs=0 if p.logprobs else None, output_kind=RequestOutputKind.DELTA)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        try:
            async for out in self.llm.generate(prompt, params, request.request_id):
                for delta in self._deltas(out, p.logprobs):
                    yield delta
        except VLLMClientError as e:
            raise InvalidArgument(f"vllm refused the request: {e}") from e
        except EngineDeadError as e:
            raise EngineDead(f"vllm engine is dead: {e}") from e

    @staticmethod
    def _deltas(out, want_logprobs: bool) -> list[Delta]:
        deltas = []
        for c in out.outputs:
            logprobs = None
            if want_logprobs:
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs or [], c.token_ids)]
            finish = _FINISH.get(c.finish_reason) if c.finish_reason else None
            detail = ""
            if finish is FinishReason.STOP:
                detail = f"stop string {c.stop_reason!r}" if isinstance(c.stop_reason, str) else "end of sequence"
            deltas.append(Delta(c.index, list(c.token_ids), c.text, logprobs, finish, detail))
        return deltas

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def pause(self, mode: PauseMode) -> None:
        await self.llm.pause_generation(mode=mode.value)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, level: int) -> None:
        # On vLLM's CPU build sleep is a no-op (sleep mode needs CUDA); the core still refuses
        # Generate until WakeUp, so the sequencing is the same everywhere.
        await self.llm.sleep(level)

    async def wake_up(self, tags: frozenset[WakeTag]) -> None:
        await self.llm.wake_up(sorted(t.value for t in tags))

    async def memory(self) -> MemoryUsage:
        per_worker = await self.llm.collective_rpc("rlsync_memory")
        device = per_worker[0]["device"]
        return MemoryUsage(device, sum(w["weights_bytes"] for w in per_worker),
                           sum(w["kv_cache_bytes"] for w in per_worker),
                           sum(w["reserved_bytes"] for w in per_worker))
