"""The process groups of routed transfers, formed once per membership and held across transfers.

Forming a group is most of a small transfer's time (NCCL builds a communicator for each pair on its
first send: about 0.7 s on two H100s), and a sharded trainer sends to the same replicas update after
update. So every member keeps the groups its transfers succeeded on (`keep`, `held()`: the newest
few), and says which in its answer (a receiver) or its RankMemory (a trainer rank). A group is out of
that set while a transfer uses it: one abandoned mid-way (a hung peer; its operations cannot be
interrupted) runs on until its timeout, and must never share its group with the next. Sender rank 0
decides each transfer's group (`decide`): the last one, when the members are the same and every one
of them still holds it, else a new one; it puts the decision in the store, and every member takes it
from there (`take`).

No collective ever runs on a group: on NCCL that would form one communicator of every member, which
NCCL refuses where two members share a GPU (a trainer rank and an engine rank colocated), while
point-to-point sends only ever join the two ends of a pair. Nor does a member wait for the others at
the end: the group stays open, and the next transfer starts only after every receiver has reported
this one. A member whose transfer failed drops the group (`release`): that closes its connections,
which fails the peers still waiting on it at once; the next transfer's decision then forms a new
group, since that member no longer lists the old one.
"""

from __future__ import annotations

import atexit
import datetime
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.distributed as dist

from rlsync.errors import FailedPrecondition, Unavailable
from rlsync.transfer.backends.collective import address_toward
from rlsync.transfer.backends.groups import leave
from rlsync.transfer.control import Deadline
from rlsync.transfer.v1 import transfer_pb2 as pb

# A group forms when every member has joined; one that never comes (dead before the transfer) must not
# hold the others for the whole transfer deadline.
JOIN_SECONDS = 30.0
HELD_MAX = 2  # groups a process keeps (a member of one sharded trainer's transfers needs one)

_HELD: OrderedDict[str, object] = OrderedDict()  # group id -> process group, newest last


def held() -> list[str]:
    """The ids of the routed groups this process holds."""
    return list(_HELD)


def release_held() -> None:
    """Drops every held group (`leave`), oldest first. Runs at exit, for the reason
    collective.release_held gives: no gloo group may outlive the interpreter's finalization."""
    while _HELD:
        leave(_HELD.popitem(last=False)[1])


atexit.register(release_held)


def key(transfer_id: str) -> str:
    """Where sender rank 0 puts a transfer's RoutedGroup in the store."""
    return f"rlsync-routed/{transfer_id}/group"


class Decider:
    """Sender rank 0's memory of the last group it chose, and the choice for the next transfer."""

    def __init__(self) -> None:
        self.members: tuple | None = None
        self.group = ""

    def decide(self, store, transfer_id: str, senders: int, answers: Sequence[pb.Answer],
               memories: Sequence[pb.RankMemory]) -> None:
        members = (senders, tuple((a.receiver_id, a.ranks) for a in answers))
        reuse = (members == self.members and
                 all(self.group in a.groups for a in answers) and all(self.group in m.groups for m in memories))
        if not reuse:
            self.members, self.group = members, uuid.uuid4().hex
        store.set(key(transfer_id), pb.RoutedGroup(id=self.group, reuse=reuse).SerializeToString())

    def forget(self) -> None:
        """The transfer failed here: the next one forms a new group."""
        self.members = None


def take(store, transfer_id: str, rank: int, world: int, device: torch.device, deadline: Deadline):
    """This transfer's group, as sender rank 0 decided: the one this process holds (taken out of the
    held set until `keep`), or a new one formed now. Returns (group id, group)."""
    try:  # a get waits for its key, up to the connection's timeout: one round trip
        store.set_timeout(datetime.timedelta(seconds=min(JOIN_SECONDS, deadline.remaining("waiting for the group"))))
        choice = pb.RoutedGroup.FromString(store.get(key(transfer_id)))
    except dist.DistError as e:
        raise Unavailable(f"{deadline.what}: sender rank 0 named no group, or its store is gone ({e})") from e
    if choice.reuse:
        if choice.id not in _HELD:
            raise FailedPrecondition(f"{deadline.what}: told to reuse routed group {choice.id[:12]}, which this "
                                     "process no longer holds")
        return choice.id, _HELD.pop(choice.id)
    try:
        return choice.id, _form(store, choice.id, rank, world, device,
                                min(JOIN_SECONDS, deadline.remaining("forming the routed group")))
    except dist.DistError as e:
        raise Unavailable(f"forming the routed group {choice.id[:12]} failed, a member is gone or unreachable: "
                          f"{e}") from e


def keep(gid: str, pg) -> None:
    """After a success: the group is held again, for the next transfer to reuse."""
    _HELD[gid] = pg
    while len(_HELD) > HELD_MAX:
        leave(_HELD.popitem(last=False)[1])


def _form(store: dist.Store, gid: str, rank: int, world: int, device: torch.device, timeout: float):
    """A process group over a connection of its own to `store`'s server (a transfer's connection is kept for
    the next transfer, which sets its timeouts: kept.CONNECTIONS), private to rlsync (no default group touched)."""
    if isinstance(store, dist.TCPStore):
        store = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
    prefixed = dist.PrefixStore(f"rlsync-routed/{gid}", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_host_of(store))]
    return dist.ProcessGroupGloo(prefixed, rank, world, options)


def _host_of(store: dist.Store) -> str:
    host = getattr(store, "host", "") or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return host
    return address_toward(host)


def release(pg, error: BaseException) -> None:
    """After a failure: the group goes at once, and with it every reference. Only its destruction
    closes its connections, which is what fails a peer still waiting on this member at once instead
    of at its deadline (gloo's shutdown leaves them open), so the failure's traceback must not keep
    it alive either."""
    leave(pg)
    traceback.clear_frames(error.__traceback__)


