"""Request bodies of the OpenAI-compatible API (pydantic), and how each becomes a GenerateRequest.

Fields rlsync cannot honour are refused by name when set to anything but their neutral value,
never silently ignored; unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from rlsync.common.v1 import generate_pb2 as pb
from rlsync.errors import InvalidArgument


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # rlsync's extensions
    top_k: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # each choice's prompt and completion token ids
    session_id: str | None = None  # requests of one session stay on one replica while it is up

    def unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _Refused(name, f"{name} is not supported (rlsync samples from the policy as it is): leave it 0")
        if self.logit_bias:
            raise _Refused("logit_bias", "logit_bias is not supported: leave it unset")

    def sampling(self, logprobs: bool) -> pb.SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return pb.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                 top_k=self.top_k, n=self.n, stop=stop, seed=self.seed, ignore_eos=self.ignore_eos,
                                 logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[StrictInt]  # (a list of texts is not a batch here: refused, not read as ids)
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: int | None = None

    def to_proto(self) -> pb.GenerateRequest:
        self.unsupported()
        if self.echo:
            raise _Refused("echo", "echo is not supported: the prompt's token ids come back with return_token_ids")
        if self.best_of not in (None, 1):
            raise _Refused("best_of", "best_of is not supported: ask for n completions and pick")
        if not self.prompt:
            raise _Refused("prompt", "prompt is empty")
        req = pb.GenerateRequest(sampling=self.sampling(self.logprobs is not None), session_id=self.session_id or "")
        if isinstance(self.prompt, str):
            req.text = self.prompt
        else:
            req.token_ids.ids.extend(self.prompt)
        return req


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(gt=0)] | None = None
    tools: list | None = None

    def to_proto(self) -> pb.GenerateRequest:
        self.unsupported()
        if self.tools:
            raise _Refused("tools", "tool calling is not parsed by rlsync: describe the tools in the messages and "
                                    "parse the assistant's text (examples/agent_openai.py does)")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        req = pb.GenerateRequest(sampling=self.sampling(self.logprobs), session_id=self.session_id or "")
        req.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.text()) for m in self.messages)
        return req


class _Refused(InvalidArgument):
    """A request field rlsync cannot honour; `param` names it (OpenAI's error shape has a field for it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
