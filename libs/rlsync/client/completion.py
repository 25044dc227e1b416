"""Builds generation requests and collects streamed chunks into completions (shared by all clients)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rlsync.common.v1 import generate_pb2 as pb

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_SAMPLING_FIELDS = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}


def generate_request(prompt: str | list[int] | list[dict], *, request_id: str = "", session_id: str = "",
                     **sampling) -> pb.GenerateRequest:
    """prompt: text, token ids, or chat messages ({"role": ..., "content": ...}, rendered by the
    model's chat template); sampling: any SamplingParams field (max_tokens=, temperature=, ...)."""
    unknown = set(sampling) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameter(s) {sorted(unknown)}; valid: {sorted(_SAMPLING_FIELDS)}")
    req = pb.GenerateRequest(request_id=request_id, session_id=session_id,
                             sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


@dataclass
class Completion:
    """One of a request's n completions, assembled from its chunks."""

    index: int
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)  # weight version of each token
    finish_reason: str = ""
    finish_detail: str = ""
    min_weight_version: int = 0
    max_weight_version: int = 0
    resubmissions: int = 0
    stale: bool = False
    chunks: int = 0

    def add(self, c: pb.GenerateChunk) -> None:
        self.chunks += 1
        if c.prompt_token_ids and not self.prompt_token_ids:
            self.prompt_token_ids = list(c.prompt_token_ids)
        self.token_ids += c.token_ids
        self.text += c.text
        self.logprobs += c.logprobs
        self.token_versions += [c.weight_version] * len(c.token_ids)
        if c.finish_reason:
            self.finish_reason = FINISH_NAMES.get(c.finish_reason, str(c.finish_reason))
            self.finish_detail = c.finish_detail
            self.min_weight_version, self.max_weight_version = c.min_weight_version, c.max_weight_version
            self.resubmissions = c.resubmissions
            self.stale = c.stale

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


def collect(chunks: Iterable[pb.GenerateChunk]) -> list[Completion]:
    """All completions of one request, by index."""
    out: dict[int, Completion] = {}
    for c in chunks:
        out.setdefault(c.index, Completion(c.index)).add(c)
    return [out[i] for i in sorted(out)]
