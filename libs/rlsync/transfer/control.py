"""The control connection of a transfer: framed msgspec messages over TCP or an abstract Unix socket,
with deadlines, immediate detection of a dead peer (EOF), and file-descriptor passing (shm)."""

from __future__ import annotations

import array
import selectors
import socket
import struct
import time
import uuid

import msgspec

from rlsync.errors import DeadlineExceeded, Unavailable
from rlsync.transfer.messages import Message

_HEADER = struct.Struct("<I")
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)
MAX_FDS = 250  # per sendmsg; the kernel allows 253 (SCM_MAX_FD)
_SEND_TIMEOUT = 300.0  # a send blocked this long has a peer that stopped reading


class Deadline:
    def __init__(self, seconds: float, what: str):
        self.end = time.monotonic() + seconds
        self.seconds = seconds
        self.what = what

    def remaining(self, doing: str = "") -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{self.what}: deadline of {self.seconds:.0f}s passed"
                                   + (f" while {doing}" if doing else ""))
        return left


class Conn:
    """One side of a control connection."""

    def __init__(self, sock: socket.socket, peer: str):
        # Timeout mode from the start (reads set theirs per deadline): the descriptor is then
        # non-blocking and every wait is Python's, as a watchdog peeking through a non-blocking
        # duplicate of it (backends/collective.py) needs.
        sock.settimeout(_SEND_TIMEOUT)
        self.sock = sock
        self.peer = peer

    def send(self, msg: Message, fds: list[int] | None = None) -> None:
        data = _ENCODER.encode(msg)
        frame = _HEADER.pack(len(data)) + data
        try:
            batches = [fds[i:i + MAX_FDS] for i in range(0, len(fds or ()), MAX_FDS)]
            if len(batches) > len(frame):
                raise ValueError(f"too many descriptors ({len(fds)}) for one message")
            for i, batch in enumerate(batches):  # one byte of the frame carries each batch
                socket.send_fds(self.sock, [frame[i:i + 1]], batch)
            self.sock.sendall(frame[len(batches):])
        except OSError as e:
            last_words = self._failure_report()
            if last_words is not None:
                raise last_words from e
            raise Unavailable(f"{self.peer} is gone ({e.strerror or e}): the transfer cannot continue") from e

    def _failure_report(self) -> Exception | None:
        """After a failed send: the failure the peer reported before it hung up, if it did."""
        from rlsync.transfer.messages import Result, error_from

        deadline = Deadline(0.5, "reading the peer's last message")
        try:
            for _ in range(1024):  # skip acknowledgements still queued before the report
                msg, _ = self.recv(deadline)
                if isinstance(msg, Result) and not msg.ok:
                    return error_from(msg.code, f"{self.peer} failed: {msg.error}")
        except Exception:  # noqa: BLE001 - nothing (more) to read
            return None
        return None

    def _read(self, n: int, deadline: Deadline, doing: str, fds: list[int]) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self.sock.settimeout(deadline.remaining(doing))
            try:
                # A read never merges data that carried descriptors with data beyond it (Linux),
                # so one batch of at most MAX_FDS arrives per call.
                data, anc, _, _ = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(MAX_FDS * 4))
            except TimeoutError:
                continue  # the deadline check above raises when it is really over
            except OSError as e:
                raise Unavailable(f"{self.peer} is gone ({e.strerror or e}) while {doing}") from e
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", payload[: len(payload) - len(payload) % 4]).tolist()
            if not data:
                raise Unavailable(f"{self.peer} closed the connection while {doing} (did the process die?)")
            buf += data
        return bytes(buf)

    def recv(self, deadline: Deadline, doing: str = "waiting for the peer") -> tuple[Message, list[int]]:
        fds: list[int] = []
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline, doing, fds))
        return _DECODER.decode(self._read(size, deadline, doing, fds)), fds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(address: str, deadline: Deadline, local: bool) -> Conn:
    """Connects to a sender: `local` = its abstract Unix socket name, else TCP 'host:port'.
    Retries until the deadline, since the sender may not be listening yet."""
    doing = f"connecting to the sender at {address}"
    while True:
        family = socket.AF_UNIX if local else socket.AF_INET6 if address.startswith("[") else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(min(5.0, deadline.remaining(doing)))
            sock.connect("\0" + address if local else _split(address))
            sock.settimeout(None)
            if not local:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return Conn(sock, f"sender at {address}")
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            sock.close()
            time.sleep(min(0.05, deadline.remaining(doing)))
        except OSError as e:
            sock.close()
            raise Unavailable(f"cannot reach the sender at {address}: {e}") from e


class Listener:
    """The sender's two endpoints: TCP (any receiver) and an abstract Unix socket (same host)."""

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None):
        self.tcp = socket.create_server((host, 0), backlog=256)
        port = self.tcp.getsockname()[1]
        self.address = f"{advertise or host}:{port}"
        self.local_name = f"rlsync-{uuid.uuid4().hex}"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind("\0" + self.local_name)
        self.unix.listen(256)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.tcp, selectors.EVENT_READ)
        self._selector.register(self.unix, selectors.EVENT_READ)

    def accept(self, deadline: Deadline, doing: str) -> Conn:
        while True:
            for key, _ in self._selector.select(timeout=min(0.5, deadline.remaining(doing))):
                sock, peer = key.fileobj.accept()
                sock.setblocking(True)
                if key.fileobj is self.tcp:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return Conn(sock, f"receiver at {peer or 'local socket'}")

    def close(self) -> None:
        self._selector.close()
        self.tcp.close()
        self.unix.close()
