"""One client class body serves both blocking and asyncio use: methods return `self._call(...)`,
which is the response for a blocking client and an awaitable for an asyncio one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

import grpc
from grpc_health.v1.health_pb2 import HealthCheckRequest
from grpc_health.v1.health_pb2_grpc import HealthStub

from rlsync.client.completion import Completion, collect, generate_request
from rlsync.client.errors import Gone, RpcError, translated
from rlsync.common.v1 import generate_pb2 as gen_pb
from rlsync.rpc.channel import aio_channel, sync_channel


class _Client:
    """What blocking and asyncio clients share: the channel (of the kind `make_channel` opens) and stub."""

    stub_class: type
    make_channel: Callable

    def __init__(self, address: str, *, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 timeout: float | None = 120.0, retries: bool = True):
        """retries: gRPC retries idempotent calls while the service is unreachable (rpc/channel.py);
        False fails them at once (the coordinator's own clients of members it heartbeats)."""
        self.address = address
        self.channel = self.make_channel(address, token, tls, tls_ca, retries=retries)
        self.stub = self.stub_class(self.channel)
        self.timeout = timeout


class SyncClient(_Client):
    make_channel = staticmethod(sync_channel)

    def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


T = TypeVar("T")
# Statuses the client's own gRPC makes up when the service did not answer (unreachable, too slow, cut off).
NOT_AN_ANSWER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


async def until_gone(call: Awaitable[T], *gone: asyncio.Future | None, method: str = "") -> T:
    """Awaits `call`, abandoning it (cancelled) the moment one of `gone` completes: raises Gone
    with that future's result, the reason. A future already done fails it at once. The one way
    the coordinator stops waiting on a member its registry dropped (a hung process answers nothing)."""
    gone = tuple(g for g in gone if g is not None)
    left = next((g for g in gone if g.done()), None)
    if left is not None:
        getattr(call, "close", getattr(call, "cancel", lambda: None))()  # never started
        raise Gone(left.result(), method)
    if not gone:
        return await call
    task = asyncio.ensure_future(call)

    def cancel(_) -> None:
        task.cancel()

    for g in gone:
        g.add_done_callback(cancel)
    try:
        return await task
    except asyncio.CancelledError:
        left = next((g for g in gone if g.done()), None)
        if left is None or asyncio.current_task().cancelling():  # cancelled from outside: not ours
            raise
        raise Gone(left.result(), method) from None
    finally:
        for g in gone:
            g.remove_done_callback(cancel)


class AsyncClient(_Client):
    make_channel = staticmethod(aio_channel)

    def __init__(self, address: str, *, gone: asyncio.Future | None = None,
                 heard: Callable[[str], None] | None = None, **kwargs):
        """gone: completed (with the reason) by whoever learns the service is gone, e.g. the
        coordinator's registry when its lease runs out: every call in flight is then abandoned with
        Gone (UNAVAILABLE), and so is every later one.
        heard: called with "answer" whenever the service answers a call (a response, or a status it
        sent itself) and with "tokens" for every chunk it streams: the registry's evidence of life."""
        super().__init__(address, **kwargs)
        self.gone = gone
        self.heard = heard

    async def _call(self, method: str, request, timeout: float | None = None):
        call = getattr(self.stub, method)(request, timeout=timeout or self.timeout)
        return await self._answered(call, method)

    async def _answered(self, call: Awaitable[T], method: str) -> T:
        try:
            with translated(method):
                response = await until_gone(call, self.gone, method=method)
        except RpcError as e:
            if self.heard is not None and not isinstance(e, Gone) and e.code not in NOT_AN_ANSWER:
                self.heard("answer")
            raise
        if self.heard is not None:
            self.heard("answer")
        return response

    async def health(self, timeout: float | None = None) -> int:
        """grpc.health.v1 Check of the whole server (its status): answered by its event loop alone, so
        a cheap way to learn that a service is alive, however busy."""
        call = HealthStub(self.channel).Check(HealthCheckRequest(), timeout=timeout or self.timeout)
        return (await self._answered(call, "Health.Check")).status

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class SyncGenerating:
    """Generate/stream/complete for blocking clients of services that generate."""

    def generate(self, prompt: str | list[int] | list[dict], **kwargs) -> Iterator[gen_pb.GenerateChunk]:
        """Streams chunks; kwargs: request_id, session_id and any SamplingParams field."""
        return self.stream(generate_request(prompt, **kwargs))

    def stream(self, request: gen_pb.GenerateRequest) -> Iterator[gen_pb.GenerateChunk]:
        """Streams the chunks of a prebuilt request."""
        call = self.stub.Generate(request)
        try:
            with translated("Generate"):
                yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | list[int] | list[dict], **kwargs) -> list[Completion]:
        """Every completion of one request, assembled (token ids, text, logprobs, versions)."""
        return collect(self.generate(prompt, **kwargs))


class AsyncGenerating:
    """The same for asyncio clients: `async for chunk in client.generate(...)`."""

    async def generate(self, prompt: str | list[int] | list[dict], **kwargs) -> AsyncIterator[gen_pb.GenerateChunk]:
        async for chunk in self.stream(generate_request(prompt, **kwargs)):
            yield chunk

    async def stream(self, request: gen_pb.GenerateRequest) -> AsyncIterator[gen_pb.GenerateChunk]:
        call = self.stub.Generate(request)
        gone = getattr(self, "gone", None)  # see AsyncClient: the stream ends with Gone once it completes
        abandon = lambda _: call.cancel()  # noqa: E731
        if gone is not None:
            gone.add_done_callback(abandon)
        try:
            heard = getattr(self, "heard", None)
            with translated("Generate"):
                async for chunk in call:
                    if heard is not None:
                        heard("tokens")
                    yield chunk
        except asyncio.CancelledError:
            if gone is None or not gone.done() or asyncio.current_task().cancelling():
                raise
            raise Gone(gone.result(), "Generate") from None
        finally:
            if gone is not None:
                gone.remove_done_callback(abandon)
            call.cancel()

    async def complete(self, prompt: str | list[int] | list[dict], **kwargs) -> list[Completion]:
        return collect([c async for c in self.generate(prompt, **kwargs)])
