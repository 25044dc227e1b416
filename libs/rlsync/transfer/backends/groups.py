"""The broadcast groups a process keeps between transfers, and the NCCL broadcasts each end posts
before the other is ready.

A group outlives one transfer (rlsync.transfer.backends.collective): the sender keeps it in its
cache under its members, a receiver in `_HELD`, and the next transfer to the same receivers uses it
again. Each transfer on a group is the same sequence of broadcasts: a 16-byte token of the
transfer's id (its `go`), then every bucket of its plan. So when a transfer's plan is the last
one's, both ends know what it will broadcast before they have spoken, and each posts its half on
NCCL's stream as soon as it can; the bytes move once both halves are posted:

- the sender once the offer is made, before any receiver answered (rlsync's trainer: while the
  replicas it rang prepare), on the one group whose last plan is the offer's (`start_ahead`); its
  send() adopts them when every receiver of the group holds it or posted on it (`take_ahead`), and
  aborts the group otherwise (a new one is made, as for new receivers);
- a receiver as it prepares, before it answers, when the offer allows it (`Offer.post_ahead`), into
  the memory the transfer lands in, on the held group whose last plan this is (`post_held`); its
  Hello lists the group as posted, and the Welcome on it adopts them (`take_posted`).

The go token makes a mismatch loud: a receiver whose posted receives carried another transfer's
bytes fails with DataLoss. A posted kernel waits on the GPU until its peer's half comes, and what
waits for the whole device meanwhile (a synchronize, a cudaFree, and under CUDA's lazy loading the
first launch of a kernel) waits for it: measured, a replica's checksum kernels launched after its
receives were posted for the next update waited for that update, which waited for the checksums.
So each end posts only once the transfer is under way (the offer made; the receiver prepared), and
what no transfer took is dropped (`cancel_ahead`, `drop_posted`: the group is aborted).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlsync.errors import Aborted, DataLoss
from rlsync.transfer.plan import cached_plan

log = logging.getLogger(__name__)
GO_BYTES = 16


@dataclass
class _Session:
    gid: str
    store: dist.Store
    group: object
    slots: list[torch.Tensor] | None = None
    plan: tuple | None = None  # (tensor sizes, bucket bytes) of the last transfer the group carried whole

    def close(self) -> None:  # a sender's cache holds sessions: WeightSender.close() releases them here
        _drop(self)


# Receiver side: sessions this process holds, by group id (a receiver may serve several senders), and
# those it posted receives on; changed under _LOCK (receivers run in threads), aborted outside it.
_HELD: OrderedDict[str, _Session] = OrderedDict()
_HELD_MAX = 4
_LOCK = threading.Lock()


def held_groups() -> list[str]:
    return list(_HELD)


def leave(group) -> None:
    """This process's end of a group goes, without waiting for any other member.

    gloo: shut down. Only destroying it closes its connections (gloo's abort and shutdown leave them
    open), and only that fails at once the peers still waiting in a broadcast with this process.
    NCCL: aborted. Its graceful end (ncclCommFinalize and ncclCommDestroy, which shutdown calls) is an
    intra-node collective that returns only once every member on this host ended the communicator
    too; a group's members hold it across transfers, so a sender closing, a membership change or an
    exit would wait for peers that never end theirs (measured: WeightSender.close() hung while its
    receiver on the other GPU of the host held the group). The abort frees this end's resources at
    once, and ends its kernels still waiting on a peer; a peer finds its end broken only if it uses it
    again, which no transfer asks of it (the group is no longer offered for reuse)."""
    try:
        if type(group).__name__ == "ProcessGroupNCCL":
            group.abort()
        else:
            group.shutdown()
    except Exception:  # noqa: BLE001 - already broken; nothing more to release
        pass


def _drop(session: _Session | None) -> None:
    """Releases the group (`leave`), once: two threads ending the same session (a sender's close and
    the end of its broadcasts sent ahead) abort it once. The last reference goes here, not when a
    traceback that holds it is freed."""
    if session is None:
        return
    with _LOCK:
        group, session.group = session.group, None
    if group is not None:
        leave(group)


def keep_held(session: _Session, plan: tuple | None) -> None:
    """A receiver's group after a transfer of `plan` (None: in deltas): offered for reuse (the oldest
    beyond a few go)."""
    session.plan = plan
    with _LOCK:
        _HELD[session.gid] = session
        old = [_HELD.popitem(last=False)[1] for _ in range(len(_HELD) - _HELD_MAX)]
    for stale in old:
        _drop(stale)


def take_held(gid: str) -> _Session:
    """The held group a sender reuses (out of _HELD while in use: one abandoned mid-way never serves
    the next transfer)."""
    with _LOCK:
        session = _HELD.pop(gid, None)
    if session is None:
        raise Aborted(f"the sender reuses broadcast group {gid[:8]}, which this process no longer holds (dropped "
                      "since its Hello): make a new offer")
    return session


def go_token(transfer_id: str) -> bytes:
    return hashlib.blake2b(transfer_id.encode(), digest_size=GO_BYTES).digest()


def check_go(go: torch.Tensor, transfer_id: str) -> None:
    """The first broadcast of a transfer names it: bytes of another transfer must not be used."""
    if bytes(go.cpu().numpy()) != go_token(transfer_id):
        raise DataLoss(f"the broadcast group carried another transfer's bytes, not transfer {transfer_id[:8]}'s: the "
                       "destination must not be used")


def go_tensor(transfer_id: str, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(go_token(transfer_id)), dtype=torch.uint8).to(device)


def _on_gpu(views: list) -> bool:
    """Every bucket has one view on the GPU where it lands or is read (NCCL's to post)."""
    return bool(views) and all(v is not None and v.device.type == "cuda" for v in views)


def _post_all(session: _Session, go: torch.Tensor, views: list[torch.Tensor], what: str) -> list | None:
    """The transfer's broadcasts on the session's group, posted now: its token, then each bucket.
    None if that failed: the group is dropped (part of a transfer may be posted on it), and the
    transfer makes a new one; posting ahead only saves time."""
    try:
        return [session.group.broadcast(go, 0), *(session.group.broadcast(v, 0) for v in views)]
    except Exception as e:  # noqa: BLE001 - see above
        log.warning("posting %s on group %s failed, it is dropped: %s", what, session.gid[:8], e)
        _drop(session)
        return None


# ---- receiver: receives posted as it prepares ---------------------------------------------------------
@dataclass
class Posted:
    session: _Session
    plan: tuple  # (tensor sizes, bucket bytes)
    views: list[torch.Tensor]  # where each bucket lands
    go: torch.Tensor
    works: list  # the go's, then each bucket's


_POSTED: dict[str, Posted] = {}
_STRANDED: list[Posted] = []  # receives an abort did not end: kept referenced, their memory is never freed


def post_held(sizes: tuple[int, ...], bucket_bytes: int, writer) -> str | None:
    """Posts, on the held NCCL group whose last transfer had this plan (`sizes` in buckets of
    `bucket_bytes`; the newest such), the receives of a transfer of that plan into `writer`'s
    destination; -> its id, or None: no such group, or a bucket that would not land in place on the
    GPU. The group is then listed as posted, not held, until a Welcome on it adopts them
    (`take_posted`) or they are dropped (`drop_posted`)."""
    drop_posted()  # an earlier transfer's that no Welcome took: no sender uses them now
    plan = (sizes, bucket_bytes)
    views = [writer.direct_span(bucket.slices) for bucket in cached_plan(sizes, bucket_bytes)]
    if not _on_gpu(views):
        return None
    with _LOCK:
        gid = next((g for g, s in reversed(_HELD.items()) if s.plan == plan), None)
        if gid is None or type(_HELD[gid].group).__name__ != "ProcessGroupNCCL":
            return None
        session = _HELD.pop(gid)
    go = torch.empty(GO_BYTES, dtype=torch.uint8, device=views[0].device)
    works = _post_all(session, go, views, "receives")
    if works is None:
        return None
    with _LOCK:
        _POSTED[gid] = Posted(session, plan, views, go, works)
    return gid


def take_posted(gid: str, sizes: tuple[int, ...], bucket_bytes: int, delta: bool = False) -> Posted | None:
    """The receives posted on `gid`, for the transfer a Welcome on that group starts. A sender reuses
    a posted group only for the plan posted, whole; another plan or deltas here are a protocol fault,
    and fail the transfer."""
    with _LOCK:
        posted = _POSTED.pop(gid, None)
    if posted is not None and (delta or posted.plan != (sizes, bucket_bytes)):
        _drop_one(posted)
        raise Aborted(f"protocol error: the sender reused group {gid[:8]} for another plan than the receives posted "
                      "on it")
    return posted


def drop_posted(keep: str | None = None, only: str | None = None) -> int:
    """Aborts the groups of posted receives (every one but `keep`'s, or `only`'s), ending their
    kernels, before their memory is used otherwise. -> how many."""
    with _LOCK:
        dropped = [_POSTED.pop(gid) for gid in list(_POSTED) if gid != keep and only in (None, gid)]
    for posted in dropped:
        _drop_one(posted)
    return len(dropped)


def _drop_one(posted: Posted, settle_seconds: float = 10.0) -> None:
    _drop(posted.session)
    deadline = time.monotonic() + settle_seconds
    while not all(w.is_completed() for w in posted.works):
        if time.monotonic() > deadline:
            log.error("receives posted on group %s did not end with its abort: their %d buckets' memory stays "
                      "referenced, never freed", posted.session.gid[:8], len(posted.views))
            _STRANDED.append(posted)
            return
        time.sleep(0.001)


# ---- sender: broadcasts posted before the answers ----------------------------------------------------
@dataclass
class Ahead:
    transfer_id: str
    key: tuple  # the group's members, as the sender's cache keys it
    session: _Session
    works: list  # the go's, then each bucket's
    keep: list  # the tensors they read

    def close(self) -> None:  # in the sender's cache until send() takes it: WeightSender.close() ends it
        _drop(self.session)


def start_ahead(cache: dict, transfer_id: str, sizes: tuple[int, ...], bucket_bytes: int, views_of) -> bool:
    """Posts the broadcasts of a transfer on the one NCCL group in `cache` whose last plan was this
    one (tensor `sizes` in buckets of `bucket_bytes`), before any receiver answered: `views_of(plan)`
    gives each bucket's bytes where a broadcast reads them, or None (then nothing is posted).
    -> whether it did. send() adopts them (`take_ahead`), or aborts the group; `cancel_ahead` too."""
    cancel_ahead(cache)
    found = [(k, s) for k, s in cache.items() if k[:1] == ("group",) and s.plan == (sizes, bucket_bytes)
             and type(s.group).__name__ == "ProcessGroupNCCL"]
    if len(found) != 1:
        return False
    key, session = found[0]
    views = views_of(list(cached_plan(sizes, bucket_bytes)))
    if not _on_gpu(views):
        return False
    go = go_tensor(transfer_id, views[0].device)
    del cache[key]
    works = _post_all(session, go, views, "broadcasts ahead")
    if works is None:
        return False
    with _LOCK:  # (cancel_ahead may run in another thread)
        cache["ahead"] = Ahead(transfer_id, key, session, works, [go, *views])
    return True


def take_ahead(cache: dict, transfer_id: str, key: tuple, plan: tuple, hellos) -> Ahead | None:
    """The broadcasts posted ahead for this transfer, when they fit it: the same members, the plan
    they were posted for, every receiver holding the group or having posted its receives. Otherwise
    their group is aborted (its kernels end) and None."""
    with _LOCK:
        ahead = cache.pop("ahead", None)
    if ahead is None:
        return None
    gid = ahead.session.gid
    if ahead.transfer_id == transfer_id and ahead.key == key and ahead.session.plan == plan and \
            all(gid in h.groups or gid in h.posted for h in hellos):
        return ahead
    _drop(ahead.session)
    return None


def cancel_ahead(cache: dict, transfer_id: str | None = None) -> None:
    """Ends broadcasts posted ahead that no send() took (the offer was abandoned): those of
    `transfer_id` only, when given (another thread may have posted a newer transfer's meanwhile)."""
    with _LOCK:
        ahead = cache.get("ahead")
        if ahead is None or (transfer_id is not None and ahead.transfer_id != transfer_id):
            return
        del cache["ahead"]
    _drop(ahead.session)


def release_held() -> None:
    """Releases every held and posted group, oldest first. Runs at exit: a gloo group still alive when
    the interpreter finalizes has worker threads that may drop a finished broadcast's tensors then,
    and taking the GIL to do it aborts the process ("terminate called without an active
    exception"). Destroyed here, while the interpreter is whole, each group joins its threads."""
    drop_posted()
    with _LOCK:
        held = [_HELD.popitem(last=False)[1] for _ in range(len(_HELD))]
    for session in held:
        _drop(session)


atexit.register(release_held)
