"""The small interface every inference engine implements, so the core never knows which one it drives."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from rlsync.rollout.types import Delta, GenerationRequest, MemoryUsage, PauseMode, WakeTag
from rlsync.errors import FailedPrecondition
from rlsync.transfer.v1.transfer_pb2 import Answer, Facts, Offer, Routing


class Engine(abc.ABC):
    """One inference engine. Implementations are asyncio-friendly and own their worker threads/processes.

    `generate` yields Deltas until every one of the request's n completions has finished; a
    completion ended by `abort`, `pause(ABORT)` or `sleep` finishes with FinishReason.ABORT.
    """

    kind: ClassVar[str]

    def __init__(self, model: str, engine_args: dict[str, Any]):
        self.model = model
        self.engine_args = dict(engine_args)

    # Facts the core needs, valid after start().
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int = 1

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model; raises with the engine's own message when an argument is wrong."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stops workers and frees memory; safe to call twice."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Ends the request's open completions with ABORT; unknown ids are ignored."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def sleep(self, level: int) -> None:
        """Releases memory; called with no request in flight."""

    @abc.abstractmethod
    async def wake_up(self, tags: frozenset[WakeTag]) -> None: ...

    @abc.abstractmethod
    async def memory(self) -> MemoryUsage: ...

    def not_ready(self) -> str | None:
        """Why the engine cannot generate right now (say, weights dropped by Sleep(2)), or None."""
        return None

    def dead(self) -> str | None:
        """Why the engine can never serve again (a worker died), or None while it can; the replica
        then reports NOT_SERVING and must be restarted."""
        return None

    # ---- weight updates: staged, then switched atomically ----------------------------------------
    #: The weight version the engine serves; it tags the tokens it produces.
    version: int = 0
    #: Bytes each engine rank received for the last update finish_update waited for.
    received_bytes: tuple[int, ...] = ()
    #: The dtype the engine computes in.
    dtype: str = ""
    #: How the engine holds quantized weights (rlsync.quant.fp8_format, from its model's quantization
    #: config), valid after start(); None: every tensor in the trainer's dtype.
    weight_format: Any = None
    #: The rules of the fused experts parameters it takes stacked (rlsync.checkpoint_names: a stacked tensor is
    #: its experts' checkpoint tensors), set after start() with WeightFormat.stacked_experts (take_stacked); ().
    stacked_rules: tuple = ()
    #: The last commit's stages, in seconds, for its CommitUpdateResponse.stages (an engine that times them).
    commit_stages: Mapping[str, float] = MappingProxyType({})

    @abc.abstractmethod
    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], None]]:
        """Names and shapes of the checkpoint tensors the engine loads (dtype: any, it casts)."""

    def take_stacked(self, rules) -> None:
        """At start: the engine takes a mixture of experts' fused parameters stacked (WeightFormat.stacked_experts:
        one tensor per layer and projection, which it hands its loaders as its experts' tensors), by `rules`
        (rlsync.checkpoint_names), where it has any and holds its weights unquantized (an FP8 format lists them
        per expert)."""
        if rules and self.weight_format is None:
            from rlsync.transfer.v1.transfer_pb2 import WeightFormat

            self.stacked_rules, self.weight_format = tuple(rules), WeightFormat(stacked_experts=True)

    def max_lora_rank(self) -> int | None:
        """The largest LoRA adapter rank this engine applies (None: any); raises FailedPrecondition,
        saying what to change, when it applies none."""
        return None

    @abc.abstractmethod
    async def prepare_update(self, offer: Offer, receiver_id: str, force_backend: str, timeout: float) -> Answer:
        """Picks the channel and starts receiving into staging memory; returns the answer."""

    @abc.abstractmethod
    async def finish_update(self, timeout: float) -> float:
        """Waits for the prepared transfer to complete and verify; returns seconds waited.
        Raises (DataLoss, Unavailable, DeadlineExceeded...) when it failed."""

    @abc.abstractmethod
    async def commit_update(self, version: int, recompute_kv: bool = False) -> int:
        """Makes the received weights live between two engine steps; requests in flight go on, on a
        KV cache rebuilt with the new weights when `recompute_kv`. Returns the completions recomputed."""

    @abc.abstractmethod
    async def abort_update(self) -> None:
        """Drops a prepared update and its staging memory."""

    async def hold_weights(self, holder: str, handles: list[bytes], facts: Facts) -> tuple[int, bytes, str]:
        """Keeps `holder`'s CUDA storages (IPC handles on this GPU, or on one it reads by P2P) mapped for
        the pulls to come (rlsync.transfer.held) -> (how many were newly mapped, the handle of a bell that
        starts a pull armed at wake, or b"": rlsync.transfer.armed; this engine's GPU when the storages lie
        on another, else ""). Only an engine that pulls where it can keep mappings can: hf in this process,
        vLLM in its worker (one worker per replica)."""
        raise FailedPrecondition(f"the {self.kind} engine receives updates outside the rollout process: it maps "
                                 "the trainer's memory at each update and holds nothing between them")

    async def read_ahead(self, routing: Routing) -> bool:
        """A sharded trainer's memories by digest, named as it onloads (HoldWeightsRequest.routing): an engine
        that copies the offers naming them at once (hf) reads them now; the others have nothing to read. -> whether
        it arms the copy of an offer naming them at its wake, for the trainer's bell to start (else the trainer is
        given no bell to write: one it armed for another trainer's pull must not start)."""
        return False

    async def release_weights(self, holder: str) -> int:
        """Closes what hold_weights kept for `holder`; returns how many."""
        return 0

    @abc.abstractmethod
    async def checksums(self) -> tuple[dict[str, tuple[str, tuple[int, ...], str]], str]:
        """({name: (dtype, shape, checksum)}, what they cover) of the weights being served."""
