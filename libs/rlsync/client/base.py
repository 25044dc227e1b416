"""One client class body serves both blocking and asyncio use: methods return `self._call(...)`,
which is the response for a blocking client and an awaitable for an asyncio one."""

from __future__ import annotations

from rlsync.client.errors import translated
from rlsync.rpc.channel import aio_channel, sync_channel


class SyncClient:
    stub_class: type

    def __init__(self, address: str, *, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 timeout: float | None = 120.0):
        self.address = address
        self.channel = sync_channel(address, token, tls, tls_ca)
        self.stub = self.stub_class(self.channel)
        self.timeout = timeout

    def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    stub_class: type

    def __init__(self, address: str, *, token: str = "", tls: bool = False, tls_ca: str | None = None,
                 timeout: float | None = 120.0):
        self.address = address
        self.channel = aio_channel(address, token, tls, tls_ca)
        self.stub = self.stub_class(self.channel)
        self.timeout = timeout

    async def _call(self, method: str, request, timeout: float | None = None):
        with translated(method):
            return await getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
