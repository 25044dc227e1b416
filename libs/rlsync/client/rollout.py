"""Typed clients of one rollout replica: `RolloutClient` (blocking) and `AsyncRolloutClient` (asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from rlsync.client.completion import Completion, collect, generate_request
from rlsync.client.errors import translated
from rlsync.common.v1 import generate_pb2 as gen_pb
from rlsync.rollout.v1 import rollout_pb2 as pb
from rlsync.rollout.v1.rollout_pb2_grpc import RolloutServiceStub
from rlsync.rpc.channel import aio_channel, sync_channel

PAUSE_MODES = {"abort": pb.PAUSE_MODE_ABORT, "keep": pb.PAUSE_MODE_KEEP, "wait": pb.PAUSE_MODE_WAIT}
WAKE_TAGS = {"weights": pb.WAKE_TAG_WEIGHTS, "kv_cache": pb.WAKE_TAG_KV_CACHE}


def pause_request(mode: str) -> pb.PauseRequest:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
    return pb.PauseRequest(mode=PAUSE_MODES[mode])


def wake_request(tags: tuple[str, ...]) -> pb.WakeUpRequest:
    unknown = set(tags) - set(WAKE_TAGS)
    if unknown:
        raise ValueError(f"wake tags must be among {sorted(WAKE_TAGS)}, got {sorted(unknown)}")
    return pb.WakeUpRequest(tags=[WAKE_TAGS[t] for t in tags])


class RolloutClient:
    """Blocking client. Errors raise rlsync.client.RpcError with the status code and message."""

    def __init__(self, address: str, *, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 timeout: float | None = 120.0):
        self.address = address
        self.channel = sync_channel(address, token, tls, tls_ca)
        self.stub = RolloutServiceStub(self.channel)
        self.timeout = timeout

    def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    def generate(self, prompt: str | list[int], **kwargs) -> Iterator[gen_pb.GenerateChunk]:
        """Streams chunks; kwargs: request_id, session_id and any SamplingParams field."""
        call = self.stub.Generate(generate_request(prompt, **kwargs))
        try:
            with translated("Generate"):
                yield from call
        finally:
            call.cancel()

    def complete(self, prompt: str | list[int], **kwargs) -> list[Completion]:
        return collect(self.generate(prompt, **kwargs))

    def abort(self, request_id: str) -> None:
        self._call("Abort", pb.AbortRequest(request_id=request_id))

    def pause(self, mode: str = "abort") -> pb.PauseResponse:
        return self._call("Pause", pause_request(mode))

    def resume(self) -> None:
        self._call("Resume", pb.ResumeRequest())

    def sleep(self, level: int = 1) -> pb.SleepResponse:
        return self._call("Sleep", pb.SleepRequest(level=level))

    def wake_up(self, *tags: str) -> pb.WakeUpResponse:
        return self._call("WakeUp", wake_request(tags))

    def info(self) -> pb.RolloutInfo:
        return self._call("GetInfo", pb.GetInfoRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRolloutClient:
    """asyncio client with the same methods as RolloutClient."""

    def __init__(self, address: str, *, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 timeout: float | None = 120.0):
        self.address = address
        self.channel = aio_channel(address, token, tls, tls_ca)
        self.stub = RolloutServiceStub(self.channel)
        self.timeout = timeout

    async def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return await getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    async def generate(self, prompt: str | list[int], **kwargs) -> AsyncIterator[gen_pb.GenerateChunk]:
        call = self.stub.Generate(generate_request(prompt, **kwargs))
        try:
            with translated("Generate"):
                async for chunk in call:
                    yield chunk
        finally:
            call.cancel()

    async def complete(self, prompt: str | list[int], **kwargs) -> list[Completion]:
        return collect([c async for c in self.generate(prompt, **kwargs)])

    async def abort(self, request_id: str) -> None:
        await self._call("Abort", pb.AbortRequest(request_id=request_id))

    async def pause(self, mode: str = "abort") -> pb.PauseResponse:
        return await self._call("Pause", pause_request(mode))

    async def resume(self) -> None:
        await self._call("Resume", pb.ResumeRequest())

    async def sleep(self, level: int = 1) -> pb.SleepResponse:
        return await self._call("Sleep", pb.SleepRequest(level=level))

    async def wake_up(self, *tags: str) -> pb.WakeUpResponse:
        return await self._call("WakeUp", wake_request(tags))

    async def info(self) -> pb.RolloutInfo:
        return await self._call("GetInfo", pb.GetInfoRequest())

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
