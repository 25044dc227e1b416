"""The OpenAI-compatible HTTP API on the coordinator's gateway (FastAPI, served by uvicorn in the
coordinator's own event loop): /v1/models, /v1/completions and /v1/chat/completions, streamed
(server-sent events) or not.

Requests go through the same gateway as gRPC's Generate, so a weight update in the middle of a
request is invisible to the caller (the gateway resubmits; the answer goes on). Every choice says
which weight version produced which of its tokens, in an `rlsync` field (`weight_version_spans`,
min/max version, resubmissions, stale; on every streamed chunk its `weight_version`), with token
ids when `return_token_ids` is set and logprobs when asked: an RL loop can train on what an agent
framework generated. Without a tokenizer here, a token in `logprobs` is named `token_id:<id>`.
The same bearer token as gRPC; errors in OpenAI's shape with the matching HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlsync.common.v1 import generate_pb2 as pb
from rlsync.coordinator.gateway import Gateway
from rlsync.coordinator.openai_schema import ChatRequest, CompletionRequest
from rlsync.errors import RlsyncError

# OpenAI's finish reasons: a completion cut short (only when its caller aborted it) reads "stop".
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "stop"}
_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
         grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.PERMISSION_DENIED: 403,
         grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
         grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _from(e: RlsyncError) -> JSONResponse:
    status = _HTTP.get(e.code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error(status, str(e), kind, getattr(e, "param", None), e.code.name.lower())


class _Unauthorized(Exception):
    pass


class _Gone(Exception):
    """The caller disconnected before its answer began."""


def make_app(gateway: Gateway, model: str, token: str = "") -> FastAPI:
    async def bearer(request: Request) -> None:  # a dependency of every route (a middleware would hide
        given = request.headers.get("authorization", "")  # the caller's disconnect from the routes)
        if token and not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise _Unauthorized

    app = FastAPI(title="rlsync", docs_url=None, redoc_url=None, openapi_url=None, dependencies=[Depends(bearer)])

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized):
        return error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' (the "
                          "coordinator's --token)", "authentication_error", code="invalid_api_key")

    @app.exception_handler(_Gone)
    async def gone(request: Request, exc: _Gone):
        return Response(status_code=499)  # nobody reads it; the gateway's request has been ended

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = _param(first["loc"])
        return error(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)

    @app.exception_handler(RlsyncError)
    async def refused(request: Request, exc: RlsyncError):
        return _from(exc)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "rlsync"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(gateway, model, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _answer(gateway, model, body, request, chat=True)

    return app


def _param(loc: tuple) -> str | None:
    """The request field an error is about, as a dotted path (messages.0.role), without pydantic's
    union-branch names."""
    parts = []
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, str) and (p in {"str", "int", "float", "bool"} or "[" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


async def _unless_gone(request: Request, work, chunks) -> object:
    """Awaits `work` unless the caller disconnects first; then the gateway's request is ended (its
    replicas abort their part) and _Gone is raised."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await chunks.aclose()
        raise _Gone
    return task.result()


async def _answer(gateway: Gateway, model: str, body: CompletionRequest | ChatRequest, http: Request, chat: bool):
    if body.model != model:
        return error(404, f"the model {body.model!r} does not exist: this fleet serves {model!r}", param="model",
                     code="model_not_found")
    request = body.to_proto()
    request.request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shape = _Shape(request.request_id, model, chat, body)
    chunks = gateway.generate(request)
    # A refused request fails on the first chunk, before any byte of an answer.
    first = await _unless_gone(http, anext(chunks), chunks)
    if body.stream:  # from here on, a caller that goes away ends the stream (and the request)
        return StreamingResponse(_events(shape, first, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def rest() -> list[pb.GenerateChunk]:
        return [c async for c in chunks]

    choices: dict[int, _Choice] = {}
    for chunk in [first] + await _unless_gone(http, rest(), chunks):
        choices.setdefault(chunk.index, _Choice()).add(chunk)
    return shape.whole([choices[i] for i in sorted(choices)])


async def _events(shape: _Shape, first: pb.GenerateChunk, rest: AsyncIterator[pb.GenerateChunk]):
    started: set[int] = set()
    usage = _Choice()  # counts every choice's tokens for the usage chunk
    try:
        chunk = first
        while True:
            yield f"data: {json.dumps(shape.chunk(chunk, chunk.index not in started))}\n\n"
            started.add(chunk.index)
            usage.count(chunk)
            chunk = await anext(rest)
    except StopAsyncIteration:
        pass
    except RlsyncError as e:  # the answer had begun: the error is the stream's last event
        yield f"data: {_from(e).body.decode()}\n\n"
    finally:  # the caller may have gone: end the gateway's request (its replicas abort theirs)
        await rest.aclose()
    if shape.body.include_usage:
        yield f"data: {json.dumps(shape.envelope([], usage=usage.usage()))}\n\n"
    yield "data: [DONE]\n\n"


class _Choice:
    """One completion assembled from its chunks."""

    def __init__(self):
        self.text, self.ids, self.logprobs, self.prompt, self.final = "", [], [], [], None
        self.prompt_tokens = 0

    def count(self, chunk: pb.GenerateChunk) -> None:
        self.ids += chunk.token_ids
        self.prompt_tokens = max(self.prompt_tokens, len(chunk.prompt_token_ids))  # one prompt for n choices

    def add(self, chunk: pb.GenerateChunk) -> None:
        self.count(chunk)
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.prompt = self.prompt or list(chunk.prompt_token_ids)
        if chunk.finish_reason:
            self.final = chunk

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.ids),
                "total_tokens": self.prompt_tokens + len(self.ids)}


class _Shape:
    """Renders chunks and choices as OpenAI's completion or chat completion objects."""

    def __init__(self, request_id: str, model: str, chat: bool, body: CompletionRequest | ChatRequest):
        self.id, self.model, self.chat, self.body = request_id, model, chat, body
        self.created = int(time.time())
        self.logprobs = bool(body.logprobs) if chat else body.logprobs is not None

    def envelope(self, choices: list[dict], **extra) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if self.chat and
                                                                             self.body.stream else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _logprobs(self, ids: list[int], values: list[float]) -> dict | None:
        if not self.logprobs:
            return None
        names = [f"token_id:{t}" for t in ids]
        if self.chat:
            return {"content": [{"token": n, "logprob": v, "bytes": None,
                                 "top_logprobs": [{"token": n, "logprob": v, "bytes": None}]
                                 if self.body.top_logprobs else []} for n, v in zip(names, values)]}
        return {"tokens": names, "token_logprobs": list(values), "text_offset": None,
                "top_logprobs": [{n: v} for n, v in zip(names, values)] if self.body.logprobs else None}

    def _versions(self, final: pb.GenerateChunk) -> dict:
        return {"weight_version_spans": [{"weight_version": s.weight_version, "start": s.start, "length": s.length}
                                         for s in final.version_spans],
                "min_weight_version": final.min_weight_version, "max_weight_version": final.max_weight_version,
                "resubmissions": final.resubmissions, "stale": final.stale}

    def chunk(self, chunk: pb.GenerateChunk, first: bool) -> dict:
        ext: dict = {"weight_version": chunk.weight_version}
        if self.body.return_token_ids:
            ext["token_ids"] = list(chunk.token_ids)
            if chunk.prompt_token_ids:
                ext["prompt_token_ids"] = list(chunk.prompt_token_ids)
        if chunk.finish_reason:
            ext |= self._versions(chunk)
        choice: dict = {"index": chunk.index, "logprobs": self._logprobs(list(chunk.token_ids), list(chunk.logprobs)),
                        "finish_reason": FINISH.get(chunk.finish_reason), "rlsync": ext}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": chunk.text} if first else {"content": chunk.text}
        else:
            choice["text"] = chunk.text
        return self.envelope([choice])

    def whole(self, choices: list[_Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            ext = self._versions(c.final) if c.final is not None else {}
            if self.body.return_token_ids:
                ext |= {"prompt_token_ids": c.prompt, "token_ids": c.ids}
            choice: dict = {"index": i, "logprobs": self._logprobs(c.ids, c.logprobs),
                            "finish_reason": FINISH.get(c.final.finish_reason) if c.final else None,
                            "rlsync": ext}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            out.append(choice)
        prompt = choices[0].prompt_tokens if choices else 0
        completion = sum(len(c.ids) for c in choices)
        return self.envelope(out, usage={"prompt_tokens": prompt, "completion_tokens": completion,
                                         "total_tokens": prompt + completion})
