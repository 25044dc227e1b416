"""A doorbell: a unary call over an abstract Unix socket, for the hops where Python gRPC's own
cost is most of the price: a colocated update's PrepareUpdate, against a copy of a few ms (and
the HoldWeights / ReleaseWeights a trainer on the replica's GPU rings at its onload and offload). Between
two bare processes a call takes 0.22 ms here against 0.57 ms for a grpc.aio health check; in a
colocated update on H100 hosts the prepare's round trip fell from 2.5 to 1.3 ms and from 1.7 to
1.1 ms (docs/performance.md).

It carries the same protobuf request and response as the gRPC method it stands for, and answers
with the same status code and message; the caller gets them as `Relayed` errors. Frames are a
4-byte length and a msgpack struct (msgspec): no pickle. The socket is abstract (no file, nothing
left behind, even on SIGKILL) and reachable only from the same network namespace; a call must
carry the server's token when it has one, as its gRPC calls must. A caller that rings often (the
trainer) keeps its connections open between calls in a `Lines`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
import uuid
from collections.abc import Awaitable, Callable

import grpc
import msgspec

from rlsync.common.stamps import stamp
from rlsync.errors import DeadlineExceeded, Relayed, Unavailable

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
_MAX_FRAME = 256 << 20  # an offer of a very large model is a few MB


class Ring(msgspec.Struct):
    token: str
    method: str
    payload: bytes  # the method's request, serialized protobuf


class Reply(msgspec.Struct):
    code: str = "OK"  # a grpc.StatusCode name
    message: str = ""
    payload: bytes = b""  # the method's response, serialized protobuf, when OK


_RING = msgspec.msgpack.Decoder(Ring)
_REPLY = msgspec.msgpack.Decoder(Reply)
_ENCODE = msgspec.msgpack.Encoder().encode

# method name -> (request parser, async handler returning the response message)
Handlers = dict[str, tuple[Callable[[bytes], object], Callable[[object], Awaitable[object]]]]


class Unreachable(Unavailable):
    """Nothing answers at the doorbell: nothing was delivered, so the call may go another way."""


def to_socket(address: str) -> str:
    """The kernel's name for an abstract address written with a leading "@"."""
    return "\0" + address[1:] if address.startswith("@") else address


async def _read(reader: asyncio.StreamReader) -> bytes | None:
    try:
        (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    except asyncio.IncompleteReadError:
        return None  # the other side closed between calls
    if n > _MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {_MAX_FRAME}")
    return await reader.readexactly(n)


def _frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


class DoorbellServer:
    """Serves `handlers` on an abstract Unix socket of its own until closed."""

    def __init__(self, handlers: Handlers, token: str, name: str):
        self.handlers, self.token, self.name = handlers, token, name
        self.address = f"@rlsync-doorbell-{name}-{uuid.uuid4().hex[:8]}"
        self._server: asyncio.AbstractServer | None = None
        self._between: set[asyncio.StreamWriter] = set()  # caller connections waiting for their next call
        self._closing = False

    async def start(self) -> str:
        self._server = await asyncio.start_unix_server(self._serve, path=to_socket(self.address))
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._closing = True
            self._server.close()
            for writer in list(self._between):  # a call being answered ends after its reply
                writer.close()
            await self._server.wait_closed()  # (Python 3.12+: until every connection has closed)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while not self._closing:  # (one accepted while the server closed ends here at once)
                self._between.add(writer)
                try:
                    data = await _read(reader)
                finally:
                    self._between.discard(writer)
                if data is None:
                    break
                stamp("read")
                writer.write(_frame(_ENCODE(await self._answer(data))))
                stamp("replied")
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
            log.warning("doorbell %s: dropped a caller: %s", self.address, e)
        except asyncio.CancelledError:  # a connection still open as its loop ends: nothing awaits this task,
            return  # and Python 3.11's StreamReaderProtocol logs a cancelled one as an unhandled error
        finally:
            writer.close()

    async def _answer(self, data: bytes) -> Reply:
        try:
            ring = _RING.decode(data)
        except msgspec.DecodeError as e:
            return Reply("INVALID_ARGUMENT", f"not a doorbell call: {e}")
        if self.token and not hmac.compare_digest(ring.token.encode(), self.token.encode()):
            return Reply("UNAUTHENTICATED", f"doorbell of {self.name}: wrong or missing token (give the caller "
                                            "the same --token as this replica)")
        if ring.method not in self.handlers:
            return Reply("UNIMPLEMENTED", f"doorbell of {self.name} has no method {ring.method!r} "
                                          f"(it serves {', '.join(sorted(self.handlers))})")
        parse, handle = self.handlers[ring.method]
        try:
            request = parse(ring.payload)
            stamp("parsed")
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, answered as such
            return Reply("INVALID_ARGUMENT", f"{ring.method}: the request does not parse: {e}")
        try:
            return Reply(payload=(await handle(request)).SerializeToString())
        except Exception as exc:  # noqa: BLE001 - mapped to a status, as the gRPC servicer does
            from rlsync.rpc.status import status_of  # (it imports the clients, which ring doorbells)

            code, message = status_of(exc, f"doorbell {ring.method}")
            return Reply(code.name, message)


Line = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Lines:
    """Connections to doorbells kept open between calls, for callers on one event loop (as a gRPC
    channel is kept): a call then costs one write and one read. A new connection costs an accept
    on the server, and its first use after seconds idle (an update after a training step) about
    twice what a kept one does (0.9 against 0.45 ms between two processes on the development
    machine). Without Lines, ring() connects for the one call."""

    def __init__(self, keep: int = 4):
        self.keep = keep  # idle connections kept per doorbell (concurrent calls open more, then close them)
        self._idle: dict[str, list[Line]] = {}

    async def send(self, frame: bytes, address: str, who: str) -> Line:
        """Writes `frame` on an idle connection to `address`, or on a new one -> the connection.
        An idle one the server closed since is dropped (nothing was written to it)."""
        self._drop_closed()
        idle = self._idle.get(address, [])
        while idle:
            line = idle.pop()
            try:
                await _write(line[1], frame)
                return line
            except ConnectionError:  # refused at the write: nothing went out
                continue
        try:
            line = await asyncio.open_unix_connection(to_socket(address))
        except OSError as e:
            raise Unreachable(f"{who}: nothing answers at doorbell {address} ({e}): the replica is gone, "
                              "restarting, or in another network namespace") from None
        await _write(line[1], frame)
        return line

    def done(self, address: str, line: Line, answered: bool) -> None:
        """Keeps a connection whose call was answered in full, for the next call; closes others."""
        idle = self._idle.setdefault(address, [])
        if answered and len(idle) < self.keep:
            idle.append(line)
        else:
            line[1].close()

    def _drop_closed(self) -> None:
        """Closes the kept connections their server has closed: a replica that went away (a new one
        has a new address, so nothing else would look at these again)."""
        for address, idle in list(self._idle.items()):
            for line in [line for line in idle if line[0].at_eof() or line[1].is_closing()]:
                idle.remove(line)
                line[1].close()
            if not idle:
                del self._idle[address]

    def close(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
        self._idle.clear()


async def _write(writer: asyncio.StreamWriter, frame: bytes) -> None:
    """Sends `frame`; a connection a failed or cancelled write leaves half-written is closed."""
    try:
        writer.write(frame)
        await writer.drain()
    except BaseException:
        writer.close()
        raise


async def ring(address: str, token: str, method: str, request, parse: Callable[[bytes], object], timeout: float,
               name: str = "", lines: Lines | None = None):
    """Calls `method` at the doorbell `address` (on a connection `lines` keeps) with `request` (the
    message, or its bytes); returns the parsed response or raises what the server answered
    (`Relayed`, its status code and message, prefixed by `name`), `Unreachable` when nobody answers
    there (nothing was sent), `Unavailable` when the server went away before answering,
    `DeadlineExceeded` after `timeout` seconds."""
    who = name or address
    lines = lines if lines is not None else Lines(keep=0)
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    frame = _frame(_ENCODE(Ring(token, method, payload)))
    data, line = None, None
    try:
        async with asyncio.timeout(timeout):
            line = await lines.send(frame, address, who)
            stamp("written")
            data = await _read(line[0])
            stamp("answered")
    except TimeoutError:
        raise DeadlineExceeded(f"{who}: {method} by doorbell did not answer within {timeout:.0f}s") from None
    except ConnectionError as e:
        log.debug("doorbell %s: %s", address, e)
    finally:
        if line is not None:
            lines.done(address, line, data is not None)
    if data is None:
        raise Unavailable(f"{who}: went away during {method} (its doorbell closed before answering)")
    reply = _REPLY.decode(data)
    if reply.code != "OK":
        raise Relayed(grpc.StatusCode[reply.code], f"{who}: {reply.message}")
    return parse(reply.payload)
