"""One client class body serves both blocking and asyncio use: methods return `self._call(...)`,
which is the response for a blocking client and an awaitable for an asyncio one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

from rlsync.client.completion import Completion, collect, generate_request
from rlsync.client.errors import Gone, translated
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

    def __init__(self, address: str, *, gone: asyncio.Future | None = None, **kwargs):
        """gone: completed (with the reason) by whoever learns the service is gone, e.g. the
        coordinator's registry when its lease runs out: every call in flight is then abandoned with
        Gone (UNAVAILABLE), and so is every later one."""
        super().__init__(address, **kwargs)
        self.gone = gone

    async def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return await until_gone(getattr(self.stub, method)(request, timeout=timeout or self.timeout), self.gone,
                                    method=method)

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
            with translated("Generate"):
                async for chunk in call:
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
