"""What every channel gets to work with, and the small helpers they share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rlsync import errors
from rlsync.common.timing import Stopwatch
from rlsync.transfer.control import Conn, Deadline
from rlsync.transfer.manifest import Spec
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.messages import Abort, Hello, Message, Result, Welcome, error_from
from rlsync.transfer.plan import Bucket
from rlsync.transfer.writer import DestWriter


@dataclass
class SendJob:
    """One backend's share of a transfer, on the sender: every receiver rank that chose it."""

    conns: list[tuple[Conn, Hello]]
    specs: list[Spec]
    # Each tensor's bytes (flat uint8), in manifest order: whole tensors, or a streamed pass that
    # produces them in order (rlsync.transfer.source; then one_copy is False).
    sources: Sequence[torch.Tensor]
    plan: list[Bucket]
    bucket_bytes: int
    verify: bool
    deadline: Deadline
    device: torch.device
    store_host: str
    transfer_id: str
    one_copy: bool = False
    arena: SharedArena | None = None
    cache: dict = field(default_factory=dict)  # buffers kept across transfers by the sender
    # Delta mode (collectives): the bytes every receiver of this job holds, in plan order (the last
    # version sent, which each of them answered it has committed); None sends every bucket whole.
    delta_base: torch.Tensor | None = None
    wire_bytes: int | None = None  # payload bytes broadcast (collectives count them; None: the data as it is)
    scratch: dict = field(default_factory=dict)  # the channel's state for this one transfer
    reported: list[dict[str, float]] = field(default_factory=list)  # each receiver's stage profile


@dataclass
class ReceiveJob:
    conn: Conn | None  # None for a pull (no sender on the line)
    welcome: Welcome
    fds: list[int]
    specs: list[Spec]
    plan: list[Bucket]
    writer: DestWriter
    device: torch.device
    deadline: Deadline
    transfer_id: str
    scratch: dict = field(default_factory=dict)  # the channel's state for this one transfer
    clock: Stopwatch = field(default_factory=Stopwatch)
    base: Mapping[str, torch.Tensor] | None = None  # delta mode: the weights this receiver holds, by name
    hold: str = ""  # cuda_ipc one-copy: keep the sender's storages mapped under this holder (transfer.held)


class Channel(Protocol):
    """A backend: both ends of moving the bytes. Each method returns only when its end is done."""

    local: bool  # True: the control connection uses the sender's same-host (Unix) endpoint

    def send(self, job: SendJob) -> None: ...

    def receive(self, job: ReceiveJob) -> None: ...


def expect(conn: Conn, kind: type, deadline: Deadline, doing: str) -> tuple[Message, list[int]]:
    """The next message, which must be of `kind`; a peer's failure report is raised as an error."""
    msg, fds = conn.recv(deadline, doing)
    if isinstance(msg, Result) and not msg.ok:
        raise error_from(msg.code, f"{conn.peer} failed: {msg.error}")
    if isinstance(msg, kind):
        return msg, fds
    if isinstance(msg, Abort):
        raise errors.Aborted(f"{conn.peer} aborted the transfer: {msg.reason}")
    raise errors.Aborted(f"protocol error: expected {kind.__name__} from {conn.peer}, got {type(msg).__name__}")


def collect_results(job: SendJob) -> None:
    """Waits for every receiver rank's final report; raises the first failure."""
    for conn, hello in job.conns:
        msg, _ = expect(conn, Result, job.deadline, f"waiting for {hello.receiver_id} rank {hello.rank} to finish")
        job.reported.append(msg.stages)


def report_failure(conn: Conn, exc: BaseException) -> None:
    """Tells the sender why this receiver failed (best effort: the sender may be gone)."""
    code = type(exc).__name__ if isinstance(exc, errors.RlsyncError) else "Aborted"
    try:
        conn.send(Result(ok=False, error=str(exc), code=code))
    except errors.RlsyncError:
        pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
