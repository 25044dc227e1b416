"""Domain types of the rollout service: what the core and the engines exchange (no protobuf here)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rlsync.errors import InvalidArgument

DEFAULT_MAX_TOKENS = 16


class FinishReason(enum.IntEnum):
    """Values equal the proto enum rlsync.common.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    ABORT = 3


class PauseMode(enum.Enum):
    ABORT = "abort"  # end requests in flight now, with partial tokens
    KEEP = "keep"  # freeze them; resume continues the same streams
    WAIT = "wait"  # let them finish; pause returns once none runs


class WakeTag(enum.Enum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


ALL_TAGS = frozenset(WakeTag)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False

    def check(self, prompt_len: int, max_model_len: int) -> None:
        """Raises InvalidArgument with what to change; never lets a bad value reach an engine."""
        if self.n <= 0:
            raise InvalidArgument(f"n must be >= 1, got {self.n}")
        if self.n > 1024:
            raise InvalidArgument(f"n must be <= 1024, got {self.n}")
        if self.n > 1 and self.temperature == 0:
            raise InvalidArgument(f"n must be 1 with temperature 0: greedy decoding would give {self.n} "
                                  "identical completions (raise temperature to sample several)")
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # also refuses NaN
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidArgument(f"top_k must be -1, 0 (both disable it) or a positive count, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must not be empty")
        if prompt_len + self.max_tokens > max_model_len:
            room = max_model_len - prompt_len
            hint = f"lower max_tokens to at most {room}" if room > 0 else "shorten the prompt"
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the model's "
                f"context of {max_model_len} tokens: {hint}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass
class Delta:
    """New tokens of one completion (one of the n), as an engine produces them."""

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] | None = None
    finish: FinishReason | None = None
    detail: str = ""
    version: int | None = None  # weight version that produced these tokens, when the engine knows it
    # On a final Delta: the engine's own record of which version made which tokens, (version, start,
    # length), when it keeps one; it wins over the per-Delta versions.
    spans: list[tuple[int, int, int]] | None = None


@dataclass
class Chunk(Delta):
    """A Delta as the core sends it out: tagged with its weight version (and more on the last one)."""

    request_id: str = ""
    weight_version: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, length)


@dataclass(frozen=True)
class MemoryUsage:
    device: str
    weights_bytes: int
    kv_cache_bytes: int
    device_reserved_bytes: int = 0
    staging_bytes: int = 0  # a prepared update being received: one more copy of the weights
    spare_bytes: int = 0  # the weights the last update retired, kept to receive the next into
