"""Control messages between the two ends of a transfer: typed msgspec structs on a socket, nothing else."""

from __future__ import annotations

import msgspec

from rlsync import errors


class Hello(msgspec.Struct, tag="hello"):
    """Receiver -> sender, first thing on the connection."""

    protocol: int
    transfer_id: str
    token: str
    receiver_id: str
    rank: int  # local rank within the receiver (e.g. tensor-parallel worker)
    ranks: int
    backend: int
    groups: list[str] = []  # broadcast groups this process still holds (they can be reused)
    posted: list[str] = []  # ... and those it posted its receives on (rlsync.transfer.backends.groups)


class Reject(msgspec.Struct, tag="reject"):
    reason: str
    code: str  # an rlsync.errors class name


class Welcome(msgspec.Struct, tag="welcome"):
    """Sender -> each receiver rank once everyone is connected: how the bytes will come."""

    backend: int
    bucket_bytes: int
    rank: int = 0  # global rank in the collective (sender is 0)
    world: int = 0
    store: str = ""  # "host:port" of the rendezvous store (gloo, nccl)
    one_copy: bool = False
    slot_bytes: int = 0  # staged: size of each slot
    slots: int = 0
    ipc: list[bytes] = []  # cuda_ipc: serialized CudaIpcHandle protos (slots, or regions in one-copy mode)
    events: list[bytes] = []  # cuda_ipc staged: IPC handles of the events that mark each slot packed
    regions: list[int] = []  # shm one-copy: byte size of each region (sent as file descriptors)
    locations: list[tuple[int, int]] = []  # one-copy: (region, byte offset) of each tensor
    dtypes: list[str] = []  # a pull that casts: each tensor's dtype in the regions (MappedTensors.dtype)
    verify: bool = False  # collectives: per-bucket checksums follow in Done
    group: str = ""  # collectives: the group's id ...
    reuse: bool = False  # ... and whether the receiver's held group of that id is used again
    delta: bool = False  # collectives: buckets may come as deltas against the receiver's base (then verify)


class Events(msgspec.Struct, tag="events"):
    """Receiver -> sender (cuda_ipc staged): IPC handles of the events that mark its slots free."""

    handles: list[bytes]


class Ready(msgspec.Struct, tag="ready"):
    bucket: int
    slot: int
    checksum: str = ""


class Freed(msgspec.Struct, tag="freed"):
    bucket: int


class Done(msgspec.Struct, tag="done"):
    checksums: list[str] = []  # per bucket (collectives verify after the fact)


class Mismatch(msgspec.Struct, tag="mismatch"):
    """Receiver -> sender after Done (delta mode): buckets whose rebuilt bytes failed their checksum."""

    buckets: list[int] = []


class Refill(msgspec.Struct, tag="refill"):
    """Sender -> every receiver (delta mode): buckets broadcast again whole, the union of all mismatches."""

    buckets: list[int] = []


class Result(msgspec.Struct, tag="result"):
    ok: bool
    nbytes: int = 0
    error: str = ""
    code: str = ""
    stages: dict[str, float] = {}  # seconds per stage on the receiver (map, copy, release, verify...)


class Abort(msgspec.Struct, tag="abort"):
    reason: str


Message = Hello | Reject | Welcome | Events | Ready | Freed | Done | Mismatch | Refill | Result | Abort


def error_from(code: str, message: str) -> errors.RlsyncError:
    """Rebuilds an error a peer reported, by its rlsync.errors class name."""
    cls = getattr(errors, code, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.RlsyncError)):
        cls = errors.Aborted
    return cls(message)
