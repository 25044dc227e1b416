"""Both ends of a routed transfer, over the same offers and answers as any other transfer.

A sharded trainer offers with `Offer.routing`: the store its ranks and the receivers meet at, and every
rank's layout by digest (kept in that store, read once by each receiver process). A receiver answers
with the boxes each of its ranks loads (`Answer.layout`). At the send, trainer rank 0 puts the roster in
the store (`make_roster`: which replicas take part, in which order, each distinct layout once); every
member then plans the same routes (`routes.cached_routes`) from the trainer's layout and every
replica's. Pairs on one GPU pull (`pulls.py`); the rest take one process group (the trainer's ranks,
then each replica's ranks in roster order; formed once per membership and held across transfers,
`routed_groups.py`) and move their pieces over it (`routed.py`): all replicas at once, each member two
operations at a time.

    sender = ShardedSender(shards, host=...)        # on every trainer rank
    offer = sender.offer(version)                   # rank 0; handed to replicas as any offer
    ans = answer(offer, "replica-0", layout=[...])  # receiver: its ranks' boxes
    RoutedReceiver(offer, ans, staging, rank=r).run()
    sender.send(offer, answers)                     # every trainer rank, the same offer and answers
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from rlsync.address import reachable_host
from rlsync.common.stamps import stamp
from rlsync.errors import (Aborted, DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable)
from rlsync.transfer import kept, pulls, relaunch, routed, routed_groups
from rlsync.transfer.control import Deadline
from rlsync.transfer.handshake import NAMES, PROTOCOL_VERSION, local_facts
from rlsync.transfer.kept import HashedKey
from rlsync.transfer.manifest import Spec, from_proto, to_proto
from rlsync.flat import Store
from rlsync.transfer.routes import Box, Layout, Piece, Routes, TensorInfo, cached_routes, layout, whole
from rlsync.transfer.sender import Report
from rlsync.transfer.copied import record_copied
from rlsync.transfer.held import HELD
from rlsync.transfer.streams import handed_over, on_transfer_stream, resolved, transfer_stream
from rlsync.transfer.v1 import transfer_pb2 as pb

log = logging.getLogger(__name__)


def to_layout_proto(held: Sequence[Sequence[Box]], facts: pb.Facts | None = None) -> pb.RankLayout:
    """One rank's boxes of each tensor, in manifest order (and where the rank runs, when given)."""
    return pb.RankLayout(tensors=[pb.RankLayout.Boxes(boxes=[
        pb.Box(start=[a for a, _ in b], stop=[e for _, e in b]) for b in boxes]) for boxes in held], facts=facts)


def layout_of(specs: Sequence[Spec], ranks: Sequence[pb.RankLayout]) -> Layout:
    """The Layout the ranks describe, checked against the manifest's tensors. The same tensors and
    ranks meet again at every update: the last few are kept, by the ranks' bytes (1.2 ms of Python
    for ~300 tensors against 0.04 ms; and the same Layout again, which cached_routes finds at once).
    A tensor's checksum, new at every version, is no part of its layout."""
    return _layout_of(_tensors(specs), tuple(r.SerializeToString() for r in ranks))


def _tensors(specs: Sequence[Spec]) -> HashedKey:
    """The manifest's tensors as a layout knows them, (name, dtype, shape, nbytes) each: a cache key, hashed once
    (a mixture of experts lists tens of thousands: hashed at each lookup, it cost milliseconds each). The last tuple
    of specs asked about is kept with its key (a receiver asks about its own several times per update, and
    from_proto gives the same tuple for the same tensors at the next; a tuple cannot change, and held here, no other
    object takes its id)."""
    global _LAST_TENSORS
    last = _LAST_TENSORS
    if last[0] is specs:
        return last[1]
    key = HashedKey(s[:4] for s in specs)
    if type(specs) is tuple:
        _LAST_TENSORS = specs, key
    return key


_LAST_TENSORS: tuple = (None, None)


@lru_cache(maxsize=8)
def _layout_of(tensors: tuple[tuple, ...], raw: tuple[bytes, ...]) -> Layout:
    specs = [Spec(name, dtype, shape, nbytes) for name, dtype, shape, nbytes in tensors]
    infos = [TensorInfo(s.name, tuple(s.shape), s.nbytes // max(math.prod(s.shape), 1) if s.nbytes else
                        torch.empty((), dtype=s.dtype).element_size()) for s in specs]
    held, parsed, boxes = [], {}, {}  # ranks of the same boxes (the same TP rank of every replica, each on
    for r, one in enumerate(raw):      # a GPU of its own: its facts differ) are read once
        if one not in parsed:
            rank = pb.RankLayout.FromString(one)
            if len(rank.tensors) != len(specs):
                raise InvalidArgument(f"rank {r}'s layout describes {len(rank.tensors)} tensors, the manifest has "
                                      f"{len(specs)}")
            rank.ClearField("facts")
            key = rank.SerializeToString()
            if key not in boxes:
                boxes[key] = [[tuple(zip(b.start, b.stop)) for b in t.boxes] for t in rank.tensors]
            parsed[one] = boxes[key]
        held.append(parsed[one])
    return layout(infos, held)


_TRAINER_LAYOUTS: OrderedDict[tuple, Layout] = OrderedDict()  # (tensors, digest) -> Layout: the last few
_TRAINER_LAYOUTS_LOCK = threading.Lock()


def _layout_key(digest: str) -> str:
    return f"rlsync-routed/layout/{digest}"


def trainer_layout(store, offer: pb.Offer, specs: Sequence[Spec]) -> Layout:
    """The trainer's layout `offer` names (Routing.layout): read from the trainer's store and checked
    against its digest the first time this process meets it, then kept (at K ranks of a few hundred
    tensors it is K x 5 KB: in every offer, it made each one that big for every replica and worker)."""
    digest = offer.routing.layout
    key = (_tensors(specs), digest)
    with _TRAINER_LAYOUTS_LOCK:
        found = _TRAINER_LAYOUTS.get(key)
        if found is not None:
            _TRAINER_LAYOUTS.move_to_end(key)
            return found
    try:  # set before any offer named it: missing, it never comes (a get would wait out the store's timeout)
        raw = store.get(_layout_key(digest)) if store.check([_layout_key(digest)]) else None
    except dist.DistError as e:
        raise Unavailable(f"the trainer's store is gone ({e})") from e
    if raw is None:
        raise FailedPrecondition(f"the trainer's store holds no layout {digest[:12]!r}: the offer is not one this "
                                 "trainer made")
    if hashlib.sha256(raw).hexdigest() != digest:
        raise DataLoss(f"the trainer's layout {digest[:12]} in its store does not match its digest")
    found = layout_of(specs, pb.TrainerLayout.FromString(raw).ranks)
    with _TRAINER_LAYOUTS_LOCK:
        _TRAINER_LAYOUTS[key] = found
        while len(_TRAINER_LAYOUTS) > 8:
            _TRAINER_LAYOUTS.popitem(last=False)
    return found


def whole_layout(specs: Sequence[Spec]) -> pb.RankLayout:
    """A receiver rank that loads every tensor whole (an engine without tensor parallelism): made once per
    list of shapes (~1 ms of Python for ~300 tensors, in every replica's answer), parsed from its bytes."""
    return pb.RankLayout.FromString(_whole_layout(tuple(tuple(s.shape) for s in specs)))


@lru_cache(maxsize=8)
def _whole_layout(shapes: tuple[tuple[int, ...], ...]) -> bytes:
    return to_layout_proto([[whole(shape)] if math.prod(shape) else [] for shape in shapes]).SerializeToString()


def _store(address: str, master: bool, timeout: float) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def _connect(address: str, timeout: float) -> tuple[dist.TCPStore, bool]:
    """A connection to the trainer's store: one this process used for an earlier transfer and left idle
    (kept.CONNECTIONS: give it back after a success), else a new one. -> (it, whether it was kept)."""
    store = kept.CONNECTIONS.take(address)
    if store is None:
        return _store(address, False, timeout), False
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store, True


def _timeout(store, seconds: float) -> None:
    """A store's get waits for its keys up to the connection's timeout: one round trip, not a wait and a get."""
    store.set_timeout(datetime.timedelta(seconds=max(seconds, 0.001)))


def _roster_key(offer: pb.Offer) -> str:
    return f"rlsync-routed/{offer.transfer_id}/roster"


def _refused_key(offer: pb.Offer) -> str:
    return f"rlsync-routed/{offer.transfer_id}/refused"


WAKE_SECONDS = 10.0  # close() waking a receiver rank: connecting to the trainer's store, one write
ARM_SECONDS = 2.0  # a receiver rank arming (RoutedReceiver._arm): reading what the offer names, which is there
OPEN_OFFERS = 16  # rank 0: offers kept open (neither sent nor refused); an older one is closed


def _waiting_key(offer: pb.Offer) -> str:
    return f"rlsync-routed/{offer.transfer_id}/waiting"


def _wake_key(offer: pb.Offer) -> str:
    """A key of one receiver rank's own (not of its name: another made for the same offer after an
    abort must not find the one this set)."""
    return f"rlsync-routed/{offer.transfer_id}/wake/{uuid.uuid4().hex}"


def _set_roster(store, offer: pb.Offer, roster: bytes) -> list[str]:
    """Rank 0: puts the roster in the store (b"": no send will come), then wakes every receiver rank
    waiting for it. -> the keys written. A store's wait is for all of its keys, never any: so each
    rank waits on a key of its own (its close() sets it too), listed under the waiting key before it
    looks for the roster; one listed after this read finds the roster there and does not wait."""
    store.set(_roster_key(offer), roster)
    waiting = _waiting_key(offer)
    store.append(waiting, b"")  # (an append is not answered: this get is the one round trip)
    wakes = store.get(waiting).decode().split()
    if wakes:
        store.multi_set(wakes, [b""] * len(wakes))
    return [_roster_key(offer), waiting, *wakes]


def _memory_key(offer: pb.Offer, rank: int) -> str:
    """A trainer rank's memory summary (pulls.summary), which every member reads."""
    return f"rlsync-routed/{offer.transfer_id}/memory/{rank}"


def _mapped_key(rank: int, digest: str) -> str:
    """A trainer rank's mapped memory (its handles and boxes) by its digest (RankMemory.digest), which only
    the receiver ranks that pull from it read, once per process: at K ranks of a few hundred tensors each,
    every member reading every rank's would move K x K x tens of KB through rank 0's store at every
    transfer, and parsing it is most of a repeat's planning. The rank keeps it there while it stays."""
    return f"rlsync-routed/mapped/{rank}/{digest}"


def _pulled_key(offer: pb.Offer, rank: int) -> str:
    return f"rlsync-routed/{offer.transfer_id}/pulled/{rank}"



def _export(memory: pb.RankMemory) -> tuple[pb.RankMemory, bytes, tuple[bytes, ...]]:
    """A trainer rank's memory as the store holds it: its summary without the groups (facts, regions and
    the digest of its mapped part), that part's bytes (b"" when nothing of it can be mapped) and its
    handles. Made once while its storages stay (ShardedSender)."""
    summary = pulls.summary(memory)
    if not memory.regions:
        return summary, b"", ()
    mapped = pb.RankMemory(ipc=memory.ipc, held=memory.held, regions=memory.regions).SerializeToString()
    summary.digest = hashlib.sha256(mapped).hexdigest()
    return summary, mapped, tuple(memory.ipc)


def _put_memory(store, offer: pb.Offer, rank: int, summary: pb.RankMemory, mapped: bytes = b"") -> None:
    """Trainer rank `rank`'s summary (_export's, with the groups it holds) for every member; `mapped`:
    its mapped part, when it has not put that since it changed (set first: one that sees the summary
    finds it)."""
    keys, values = ([_mapped_key(rank, summary.digest)], [mapped]) if mapped else ([], [])
    store.multi_set([*keys, _memory_key(offer, rank)], [*values, summary.SerializeToString()])


def _memories(store, offer: pb.Offer, senders: int, deadline: Deadline,
              own: tuple[int, pb.RankMemory] | None = None) -> list[pb.RankMemory]:
    """Every trainer rank's memory summary, as each puts it in the store when it starts to send (`own`: a
    trainer rank's own, which it does not read back)."""
    ranks = [k for k in range(senders) if own is None or k != own[0]]
    read = dict(zip(ranks, _read(store, [_memory_key(offer, k) for k in ranks], deadline))) if ranks else {}
    return [read[k] if k in read else own[1] for k in range(senders)]


_MAPPED = kept.Kept(8)  # digest -> a trainer rank's mapped memory, parsed: the few ranks this process pulls from


def _held_memories(store, summaries: Sequence[pb.RankMemory], ranks: Sequence[int],
                   deadline: Deadline) -> dict[int, pb.RankMemory]:
    """The mapped memory of each trainer rank in `ranks` (those a receiver rank pulls from), by the digest its
    summary names: read, checked and parsed the first time this process meets that digest, then kept (a
    repeat from storages that stayed reads and parses nothing). Each has its digest set."""
    def fetch(rank: int, digest: str) -> pb.RankMemory:
        (raw,) = _read(store, [_mapped_key(rank, digest)], deadline, parse=False)
        if hashlib.sha256(raw).hexdigest() != digest:
            raise DataLoss(f"{deadline.what}: trainer rank {rank}'s memory in its store does not match its digest")
        memory = pb.RankMemory.FromString(raw)
        memory.digest = digest
        return memory
    return {k: _MAPPED.get(summaries[k].digest, lambda k=k: fetch(k, summaries[k].digest)) for k in ranks}


def learn(routing: pb.Routing) -> int:
    """A receiver process told of a sharded trainer's memories ahead of its offers (HoldWeightsRequest.routing,
    at the trainer's onload): reads each rank's mapped memory the digests name, and what a held pull derives from
    it (pulls.held_shape), so that an armed pull of an offer naming them reads nothing. -> how many it read (0:
    all known). Waits ARM_SECONDS at most."""
    deadline = Deadline(ARM_SECONDS, "reading the trainer's memories ahead of its offers")
    misses = _MAPPED.misses
    store = _Lazy(routing.store, deadline)
    held = _held_memories(store, [pb.RankMemory(digest=d) for d in routing.memories], range(len(routing.memories)),
                          deadline)
    store.give_back()
    for memory in held.values():
        pulls.held_shape(memory)
    return _MAPPED.misses - misses


def known(memories: Sequence[str]) -> bool:
    """Whether this process has read every one of these trainer ranks' mapped memories (`learn`, or a pull): an
    armed receiver then reads nothing of the store."""
    return bool(memories) and all(_MAPPED.peek(d) is not None for d in memories)


def _read(store, keys: list[str], deadline: Deadline, parse: bool = True) -> list:
    try:
        _timeout(store, min(routed_groups.JOIN_SECONDS, deadline.remaining("meeting the trainer")))
        values = store.multi_get(keys)
    except dist.DistError as e:
        raise Unavailable(f"{deadline.what}: a trainer rank did not start sending, or its store is gone ({e})") from e
    return [pb.RankMemory.FromString(v) for v in values] if parse else values


def _await_pulls(store, offer: pb.Offer, ranks: Sequence[int], deadline: Deadline) -> None:
    """Until every receiver rank in `ranks` says it has copied what it pulls from this rank (after
    which this rank's memory may change); one that failed fails this rank too, with its reason."""
    if not ranks:
        return
    keys = [_pulled_key(offer, r) for r in ranks]
    try:
        _timeout(store, deadline.remaining("waiting for the pulls"))
        outcomes = store.multi_get(keys)
    except dist.DistError as e:
        raise DeadlineExceeded(f"{deadline.what}: receiver ranks {list(ranks)} did not finish pulling in time "
                               f"({e})") from e
    failed = [(r, o.decode(errors="replace")) for r, o in zip(ranks, outcomes) if o]
    if failed:
        raise Unavailable(f"{deadline.what}: receiver rank {failed[0][0]} failed to pull its pieces: {failed[0][1]}")


def _say(store, key: str, value: bytes) -> None:
    try:
        store.set(key, value)
    except dist.DistError:  # the trainer's store is gone: nobody is left to tell
        pass


def engine_facts(answers: Sequence[pb.Answer]) -> list[pb.Facts]:
    """Where each receiver rank of the roster runs (its layout's facts, else its answer's)."""
    return [rank.facts if rank.HasField("facts") else a.facts for a in answers for rank in a.layout]


def engine_layout(specs: Sequence[Spec], answers: Sequence[pb.Answer]) -> Layout:
    """Every receiver rank of the roster, replica after replica."""
    for a in answers:
        if len(a.layout) != a.ranks:
            raise InvalidArgument(f"{a.receiver_id!r} answered for {a.ranks} ranks with a layout of {len(a.layout)}: "
                                  "answer a routed offer with one layout per rank")
    return layout_of(specs, [rank for a in answers for rank in a.layout])


def make_roster(answers: Sequence[pb.Answer]) -> pb.Roster:
    """The roster of these answers (see Roster): each distinct layout once."""
    out, index = pb.Roster(), {}
    for answer in answers:
        a = pb.Answer()  # its ranks' facts come off in place: a copy is one C call, a copy of each rank 10x that
        a.CopyFrom(answer)
        for rank in a.layout:
            out.facts.append(rank.facts if rank.HasField("facts") else a.facts)
            rank.ClearField("facts")
            raw = rank.SerializeToString()
            if raw not in index:
                index[raw] = len(index)
                out.layouts.append(rank)
            out.layout_of.append(index[raw])
        a.ClearField("layout")
        out.answers.append(a)
    return out


def roster_layout(specs: Sequence[Spec], roster: pb.Roster) -> Layout:
    """Every receiver rank of the roster, replica after replica (the same Layout as engine_layout of
    the answers it was made of)."""
    if len(roster.layout_of) != sum(a.ranks for a in roster.answers) or any(
            not 0 <= i < len(roster.layouts) for i in roster.layout_of):
        raise InvalidArgument("a roster whose ranks' layouts do not match its answers: the trainer's rank 0 made it "
                              "wrong")
    distinct = [r.SerializeToString() for r in roster.layouts]
    return _layout_of(_tensors(specs), tuple(distinct[i] for i in roster.layout_of))


def _staging(specs: Sequence[Spec], dest: Mapping[str, torch.Tensor],
             boxes: Mapping[str, Box] | None) -> dict[str, tuple[Box, torch.Tensor]]:
    """Each manifest tensor `dest` has: the box of the whole tensor it holds (`boxes`; whole by default), and it."""
    boxes = boxes or {}
    return {s.name: (boxes.get(s.name) or whole(s.shape), dest[s.name]) for s in specs if s.name in dest}


def _bucket(offer: pb.Offer, answers: Sequence[pb.Answer]) -> int:
    return min(a.bucket_bytes or offer.bucket_bytes for a in answers)


class ShardedSender:
    """One trainer rank's end: `layout` says what every rank holds of each tensor of `specs`, and
    `piece` cuts a piece from this rank's own shards (contiguous, in the spec's dtype). Rank 0 hosts
    the store (on `host`, advertised as `advertise`) and makes offers; every rank sends."""

    format: pb.WeightFormat | None = None  # the format its specs were quantized to (Manifest.format), if any

    def __init__(self, layout: Layout, specs: Sequence[Spec], rank: int, piece: Callable[[Piece], torch.Tensor], *,
                 bucket_bytes: int, host: str = "127.0.0.1", advertise: str | None = None,
                 device: torch.device | None = None,
                 held: Callable[[], Sequence[Sequence[torch.Tensor]]] | None = None,
                 where: Callable[[], Hashable] | None = None,
                 source: Callable[[Piece], tuple[torch.Tensor, torch.dtype]] | None = None):
        """held: the tensors of this rank's boxes (per tensor, in its layout's order), for receiver
        ranks on its GPU to pull from (pulls.py); without it every receiver gets its pieces over the group.
        where: a key of where held()'s tensors lie, equal only while none has moved, cheaper than held()
        (RankShards.where); by default kept.where of held()'s tensors.
        source: a piece's values where they lie and the dtype they travel in (RankShards.piece_source), so that
        the pieces of a bucket are packed into it in one launch (routed.send)."""
        self.layout, self.specs, self.rank, self.piece, self.held = layout, tuple(specs), rank, piece, held
        self.source = source
        self.where = where or (lambda: kept.where(t for tensors in held() for t in tensors))
        self.world, self.bucket_bytes = layout.ranks, bucket_bytes
        self.device = device or torch.device("cpu")
        self._store = None
        self._shares: dict = {}  # exported CUDA IPC handles, kept until close() (the trainer offloads)
        # This rank's exports by where its storages lie (kept.where) and its facts: a repeat update from
        # storages that stayed exports nothing; one that moved (and keeps the old alive in _shares, so no
        # address repeats) is another key, and another digest for the receivers.
        self._exports = kept.Kept(2)
        self._packs = kept.Kept(1)  # how it packed its last buckets (routed.Plans), by routes and where storages lie
        self._mapped = ""  # the digest of the mapped memory this rank last put in the store
        self._spent: list[str] = []  # rank 0: the store keys of the last transfer
        self._open: OrderedDict[str, pb.Offer] = OrderedDict()  # rank 0: offers neither sent nor refused yet
        self._group = routed_groups.Decider()  # rank 0: the routed group of the last transfer
        if self.rank == 0:  # the one that offers, and keeps the layout its offers name
            raw = pb.TrainerLayout(ranks=[to_layout_proto(r) for r in layout.held]).SerializeToString()
            self._layout = hashlib.sha256(raw).hexdigest()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            self._store.set(_layout_key(self._layout), raw)
            self.store_address = f"{advertise or reachable_host(host)}:{self._store.port}"
        self.backends = [pb.BACKEND_CUDA_IPC, pb.BACKEND_NCCL] if self.device.type == "cuda" else [pb.BACKEND_GLOO]

    def offer(self, version: int) -> pb.Offer:
        if self.rank != 0:
            raise FailedPrecondition("offers are made by rank 0 of the trainer")
        offer = pb.Offer(
            protocol_version=PROTOCOL_VERSION, manifest=to_proto(self.specs, version, self.format),
            facts=local_facts(self.device), backends=self.backends, token=secrets.token_hex(16),
            bucket_bytes=self.bucket_bytes, transfer_id=uuid.uuid4().hex, routing=self.routing())
        self._open[offer.transfer_id] = offer
        while len(self._open) > OPEN_OFFERS and self._store is not None:
            self._close_offer(self._store, self._open.popitem(last=False)[1], "too many newer offers were made")
        return offer

    def routing(self, memories: Sequence[str] = ()) -> pb.Routing:
        """Rank 0: where receivers meet this trainer (its store, its layout's digest), and `memories`: every rank's
        mapped memory by its digest (`described`)."""
        return pb.Routing(store=self.store_address, layout=self._layout, memories=memories)

    def send(self, offer: pb.Offer, answers: Sequence[pb.Answer], timeout: float = 300.0) -> Report:
        """This rank's pieces to every answering replica's ranks; returns what it sent."""
        deadline = Deadline(timeout, f"routed transfer {offer.transfer_id[:8]} (version {offer.manifest.version})")
        start = time.perf_counter()
        for a in answers:
            if a.transfer_id != offer.transfer_id:
                raise InvalidArgument(f"answer from {a.receiver_id!r} is for transfer {a.transfer_id!r}, "
                                      f"not {offer.transfer_id!r}: pass the answers to this offer")
        store = self._store if self._store is not None else _connect(offer.routing.store,
                                                                     deadline.remaining("joining the store"))[0]
        engine = engine_layout(self.specs, answers)
        routes = cached_routes(self.layout, engine)
        facts, receivers = local_facts(self.device), engine_facts(answers)
        near = self.held is not None and any(pulls.same_gpu(facts, f) for f in receivers)
        summary, mapped, _ = self._exported(facts, near)
        mine = pb.RankMemory(facts=summary.facts, regions=summary.regions, digest=summary.digest,
                             groups=routed_groups.held())
        fresh = self._mapped != summary.digest  # the mapped part is in the store from the last put till it changes
        _put_memory(store, offer, self.rank, mine, mapped if fresh else b"")
        if fresh:
            self._unmap(store, summary.digest)
        spent = []  # rank 0: the transfer before's keys, which every member is done with
        if self.rank == 0:  # its memory, then the roster: a receiver rank of K = 1 waits for nothing more
            spent, self._spent = self._spent, []
            self._close_others(store, offer, "a newer offer was sent")
            self._spent += [*(_memory_key(offer, k) for k in range(self.world)),
                            *(_pulled_key(offer, e) for e in range(engine.ranks)), routed_groups.key(offer.transfer_id),
                            *_set_roster(store, offer, make_roster(answers).SerializeToString())]
            stamp("rostered")
        profile = {"export": time.perf_counter() - start}
        gid, pg, members = "", None, self.world + engine.ranks
        try:
            memories = _memories(store, offer, self.world, deadline, own=(self.rank, mine))
            pulled, pushed = pulls.split(routes, memories, receivers)
            profile["meet"] = time.perf_counter() - start - profile["export"]
            sent = _wire_bytes(pulled, self.rank)
            if any(t.dsts for t in pushed.transfers):
                if self.rank == 0:
                    self._group.decide(store, offer.transfer_id, self.world, answers, memories)
                gid, pg = routed_groups.take(store, offer.transfer_id, self.rank, members, self.device, deadline)
                profile["group"] = time.perf_counter() - start - profile["export"] - profile["meet"]
                bucket = _bucket(offer, answers)
                packs = None if self.source is None else self._packs.get(
                    (pushed, bucket, self.where()), routed.Plans)
                sent += routed.send(pg, pushed, self.rank, self.piece, bucket, deadline, self.device, profile,
                                    self.source, packs)
            _delete(store, spent)  # while the receiver ranks pull (one round trip each)
            spent = []
            waited = time.perf_counter()
            _await_pulls(store, offer, sorted({d for t in pulled.of_sender(self.rank) for d in t.dsts}), deadline)
            profile["pulls"] = time.perf_counter() - waited
        except BaseException as e:
            if self.rank == 0:
                self._spent += spent
                self._group.forget()
            if pg is not None:
                routed_groups.release(pg, e)
            del pg
            raise
        if pg is not None:
            routed_groups.keep(gid, pg)
        if store is not self._store:
            kept.CONNECTIONS.give(offer.routing.store, store)
        seconds = time.perf_counter() - start
        return Report(sent, seconds, _channels(pulled, pushed, self.backends[-1], sender=self.rank), seconds,
                      {"data": seconds, **profile}, sent)

    def _exported(self, facts: pb.Facts, near: bool) -> tuple[pb.RankMemory, bytes, tuple[bytes, ...]]:
        """This rank's memory as the store holds it (_export's), and its handles: `near`, with what receiver
        ranks on its GPU map. Kept while its storages stay: a repeat calls no held()."""
        key = (facts.SerializeToString(), near and self.where())
        return self._exports.get(key, lambda: _export(pulls.memory(self.held() if near else None, facts,
                                                                   self._shares)))

    def _unmap(self, store, digest: str) -> None:
        """This rank put its mapped memory of `digest`: the one it put before goes (the transfers that could
        read it are over)."""
        if self._mapped:
            _delete(store, [_mapped_key(self.rank, self._mapped)])
        self._mapped = digest

    def refuse(self, offer: pb.Offer, reason: str) -> None:
        """Rank 0: tells the receivers waiting for this offer's roster that no send will come, and why."""
        if self._store is not None:
            self._forget(self._store)
            self._close_others(self._store, offer, "a newer offer was refused")
            self._close_offer(self._store, offer, reason)

    def _close_offer(self, store, offer: pb.Offer, reason: str) -> None:
        """Rank 0: no send of `offer` will come: its receivers waiting for the roster wake with
        `reason`, and its keys go with the next transfer's (_forget)."""
        self._open.pop(offer.transfer_id, None)
        self._spent.append(_refused_key(offer))
        store.set(_refused_key(offer), reason.encode())
        self._spent += _set_roster(store, offer, b"")  # wakes the receivers waiting for the roster

    def _close_others(self, store, offer: pb.Offer, reason: str) -> None:
        """Rank 0, as `offer` is sent or refused: the offers made before it that were neither are
        closed (their receivers would wait out their deadline, and their keys stay in the store)."""
        self._open.pop(offer.transfer_id, None)
        for older in list(self._open.values()):
            self._close_offer(store, older, f"{reason} (transfer {offer.transfer_id[:8]}): this one never will be")

    def _forget(self, store) -> None:
        """Rank 0: drops the keys of the transfer before (every member is done with it once another
        starts), so a long run does not pile up every transfer's keys in the store."""
        spent, self._spent = self._spent, []
        _delete(store, spent)

    def describe(self) -> pb.RankDigest:
        """Every rank, as rank 0 makes an offer for replicas that hold the trainer's storages (Routing.memories):
        this rank's mapped memory by its digest, with the memory itself when the store does not hold it yet
        (rank 0 puts it there: `described`). Empty when its storages cannot be mapped. Its weights are final on the
        GPU when it returns: once rank 0 has every rank's digest, a replica's copy armed behind its bell may start
        (rank 0 writes the bell before it rings: rlsync.transfer.armed), and no other rank's stream orders it."""
        if self.held is None or self.device.type != "cuda":
            return pb.RankDigest()
        torch.cuda.current_stream(self.device).synchronize()
        summary, mapped, _ = self._exported(local_facts(self.device), True)
        out = pb.RankDigest(digest=summary.digest)
        if summary.digest and self._mapped != summary.digest:
            out.mapped, out.replaces = mapped, self._mapped
        return out

    def stored(self, every: Sequence[pb.RankDigest]) -> None:
        """Every rank, once the ranks agreed that rank 0 put what `every` rank described (`described`): this rank's
        mapped memory is in the store from now on, and its sends put it no more."""
        if every[self.rank].mapped:
            self._mapped = every[self.rank].digest

    def described(self, every: Sequence[pb.RankDigest]) -> list[str]:
        """Rank 0, with every rank's `describe()` in rank order: puts each mapped memory the store lacks (the one
        it replaces goes; each rank learns it is there from `stored`) -> every rank's digest, or [] when one rank's
        storages cannot be mapped."""
        keys, values, gone = [], [], []
        for rank, d in enumerate(every):
            if d.mapped:
                if hashlib.sha256(d.mapped).hexdigest() != d.digest:
                    raise DataLoss(f"trainer rank {rank}'s mapped memory does not match its digest")
                keys.append(_mapped_key(rank, d.digest))
                values.append(d.mapped)
                gone += [_mapped_key(rank, d.replaces)] if d.replaces else []
        if keys:
            self._store.multi_set(keys, values)
            _delete(self._store, gone)
        return [d.digest for d in every] if all(d.digest for d in every) else []

    def settled(self, offer: pb.Offer) -> None:
        """Rank 0: every replica rung with `offer` copied it as it prepared (Routing.memories): none waits for its
        roster, so it is not closed later (a send to replicas prepared otherwise may still come)."""
        self._open.pop(offer.transfer_id, None)

    def regions(self) -> pb.MappedTensors | None:
        """This rank's storages as receiver ranks on its GPU map them to pull (its export, which its sends
        then reuse while the storages stay), or None when they cannot be mapped. The trainer's rank 0 gathers
        every rank's at an onload, and the replicas on the GPU hold them all (HoldWeights): each rank's, in
        rank order, is the list a receiver rank's pull holds (pulls.pull), so the pull maps nothing."""
        if self.held is None or self.device.type != "cuda":
            return None
        ipc = self._exported(local_facts(self.device), True)[2]
        return pb.MappedTensors(ipc=ipc) if ipc else None

    def close(self) -> None:
        if self._store is not None:
            try:
                for offer in list(self._open.values()):
                    self._close_offer(self._store, offer, "the trainer's sender closed")
            except dist.DistError:
                pass
        self._store = None
        self._shares = {}
        self._exports.clear()
        self._packs.clear()  # its slots, and its views of the storages (an offload frees them)
        self._mapped = ""


class _Lazy:
    """The trainer's store, joined at its first use (a kept connection, given back after): a repeat that finds
    all it needs kept joins nothing."""

    def __init__(self, address: str, deadline: Deadline):
        self.address, self.deadline, self._store = address, deadline, None

    def __getattr__(self, name: str):
        if self._store is None:
            self._store = _connect(self.address, self.deadline.remaining("joining the store"))[0]
        return getattr(self._store, name)

    def give_back(self) -> None:
        if self._store is not None:
            kept.CONNECTIONS.give(self.address, self._store)


def _delete(store, keys: Sequence[str]) -> None:
    for key in keys:
        try:
            store.delete_key(key)
        except dist.DistError:
            break


@lru_cache(maxsize=16)
def _wire_bytes(routes: Routes, rank: int) -> int:
    """What trainer rank `rank` moves on these routes: each piece once per receiver."""
    return sum(p.nbytes(routes.tensors) * len(t.dsts) for t in routes.of_sender(rank) for p in t.pieces)


def _channels(pulled: Routes, pushed: Routes, backend: int, *, sender: int | None = None,
              receiver: int | None = None) -> dict[str, int]:
    """Pairs of one member, by channel: cuda_ipc pulls, and the group's backend for the rest."""
    def pairs(routes: Routes) -> int:
        if sender is not None:
            return len({d for t in routes.of_sender(sender) for d in t.dsts})
        return len({t.src for t in routes.of_receiver(receiver)})
    out = {"cuda_ipc": pairs(pulled), NAMES[backend]: pairs(pushed)}
    return {k: v for k, v in out.items() if v}


class RoutedReceiver:
    """One receiver rank's end (the interface of transfer.Receiver: run(), close()). `dest` holds this
    rank's box of each tensor it loads, by name (`boxes[name]` says which box; whole by default).
    hold: what it pulls on the trainer's GPU, it keeps mapped under this holder name (pulls.pull):
    the caller must `HELD.release(hold)` before the trainer's memory may leave the GPU (a replica does when
    the trainer asks: ReleaseWeights). keep: where the writer of what comes over the group, laid out over
    `dest`, is kept for the next update into the same memory (kept.writer), and so is an armed pull's launch
    (rlsync.transfer.relaunch): a dict that lives as long as `dest` does, for this rank and its boxes alone, by
    default the `memo` of a store whose `views` stay where they are while it lives (a FlatStore, a vLLM worker's
    BoxStaging); None (a dict of tensors): laid out at each update.
    at_once: a caller that runs a pull before it answers (answer.pull), as transfer.Receiver's: when the offer
    names the trainer ranks' memories (Routing.memories) and this process holds every storage this rank pulls
    from under `hold`, it sets answer.pull, and run() queues the copy at once (no roster, no exchange with
    the trainer's ranks) and reports the event after it (Report.copied), which the trainer waits for."""

    def __init__(self, offer: pb.Offer, answer: pb.Answer, dest: Mapping[str, torch.Tensor] | Store, *,
                 rank: int = 0, device: torch.device | str | None = None, timeout: float = 300.0,
                 boxes: Mapping[str, Box] | None = None, hold: str = "", keep: dict | None = None,
                 at_once: bool = False):
        self.offer, self.answer, self.rank, self.hold = offer, answer, rank, hold
        # (a store: its views stay where they are, and its memo keeps what is laid out over them)
        self._memo = None if isinstance(dest, Mapping) else dest.memo
        self.keep = keep if keep is not None else self._memo
        self.specs = tuple(from_proto(offer.manifest))
        self.device = resolved(torch.device(device)) if device is not None else torch.device("cpu")
        self.trainer: Layout | None = None  # read when armed, else at run() (trainer_layout)
        layout_of(self.specs, answer.layout)  # a layout that does not fit the manifest is refused now
        self._boxes = boxes  # (its staging's boxes: whole tensors when None)
        self._flat: list | None = None  # into a store: its memo's entry of this staging (_flat_staging)
        # (the staging, and what names where it lies for kept.writer: into a store, kept in its memo)
        self.staging, self._placed = self._flat_staging(dest) if self._memo is not None else (_staging(
            self.specs, dest, boxes), None)
        self.deadline = Deadline(timeout, f"receiving routed transfer {offer.transfer_id[:8]} "
                                          f"(version {offer.manifest.version})")
        self.start = time.perf_counter()
        self._pg = None
        self._closed = False
        self._lock = threading.Lock()
        self._waiting = False  # run() waits on its key `_wake` for the roster: close() sets it
        self._wake = _wake_key(offer)
        self.handed = handed_over(self.device)  # as transfer.Receiver: on a stream of its own
        # A repeat from storages this process holds (Routing.memories), for a caller that answers it as a pull
        # (at_once): run() copies at once. answer.pull is set here: the caller runs it before it answers.
        self.armed, self._arming = None, 0.0
        if at_once and hold and self.device.type == "cuda" and offer.routing.memories:
            try:
                arming = time.perf_counter()
                self.armed = self._arm()
                self._arming = time.perf_counter() - arming
            except Exception as e:  # noqa: BLE001 - (what the offer names was put before it left): run() meets them
                log.warning("%s: meeting the trainer's ranks instead of copying at once: %s", self.deadline.what, e)
        self._queued = False  # run() queued an armed copy that close() must let end first
        if self.armed is not None:
            answer.pull = True

    def _arm(self) -> tuple[Routes, dict[int, pb.RankMemory]] | None:
        """What this rank pulls from the trainer's ranks, when the offer names their memories and this process
        holds every storage it pulls from: (its routes, those ranks' memories), else None (run() meets the
        trainer's ranks). Their layouts and memories were read when first met: a repeat reads nothing. What it
        reads (it may run on a caller's event loop) waits ARM_SECONDS at most: the offer's keys were put before
        it left, so one missing is a trainer that failed to put it, not one that is slow."""
        deadline = Deadline(min(ARM_SECONDS, self.deadline.remaining("arming")), f"arming {self.deadline.what}")
        store = _Lazy(self.offer.routing.store, deadline)
        trainer = trainer_layout(store, self.offer, self.specs)
        digests = list(self.offer.routing.memories)
        if len(digests) != trainer.ranks or not all(digests):
            store.give_back()
            return None
        routes = cached_routes(trainer, layout_of(self.specs, self.answer.layout))
        sources = sorted({t.src for t in routes.of_receiver(self.rank)})
        held = _held_memories(store, [pb.RankMemory(digest=d) for d in digests], sources, deadline)
        store.give_back()  # (only after a success: one that failed may be in any state)
        handles = [h for k in sources for h in held[k].ipc]
        if not handles or any(t is None for t in HELD.get_many(handles)):
            return None
        self.trainer = trainer
        return routes, held

    def _roster(self, store) -> tuple[pb.Roster, int]:
        """The replicas taking part (as the trainer's rank 0 put them), and this rank's place among
        all their ranks. Waits for it until the deadline, a refusal from the trainer, or close(), on
        a key of its own that the trainer sets with the roster (_set_roster) and close() sets too:
        the store wakes this wait as the key is set (a poll would add its period to every transfer)."""
        key = _roster_key(self.offer)
        try:
            store.append(_waiting_key(self.offer), self._wake + "\n")
            ready = store.check([key])  # after the append (see _set_roster); not under the lock close() takes
            with self._lock:
                self._waiting = not self._closed and not ready
            if self._waiting:
                try:
                    store.wait([self._wake], datetime.timedelta(
                        seconds=self.deadline.remaining("waiting for the trainer to send")))
                    ready = True  # woken by the roster (or by close(), told below)
                except dist.DistError:  # the deadline, or the store is gone: told apart below
                    pass
                with self._lock:
                    self._waiting = False
            if self._closed:
                raise Aborted(f"{self.deadline.what}: closed before the trainer sent")
            if not ready and not store.check([key]):
                self.deadline.remaining("waiting for the trainer to send")
                raise Unavailable(f"{self.deadline.what}: the trainer's store stopped answering")
            raw = store.get(key)
            if not raw:  # a refusal: the trainer set its reason first
                raise Unavailable(f"{self.deadline.what}: "
                                  f"{store.get(_refused_key(self.offer)).decode(errors='replace')}")
        except dist.DistError as e:
            raise Unavailable(f"{self.deadline.what}: the trainer's store is gone ({e})") from e
        roster = pb.Roster.FromString(raw)
        answers = roster.answers
        ids = [a.receiver_id for a in answers]
        if self.answer.receiver_id not in ids:
            raise FailedPrecondition(f"the trainer sends transfer {self.offer.transfer_id[:8]} to {ids}, not to "
                                     f"{self.answer.receiver_id!r}: this prepared update was dropped from it")
        index = ids.index(self.answer.receiver_id)
        return roster, sum(a.ranks for a in answers[:index]) + self.rank

    def run(self) -> Report:
        with on_transfer_stream(self.device, self.handed):
            return self._run()

    def _run(self) -> Report:
        if self.armed is not None:
            return self._pull_armed()
        address = self.offer.routing.store
        store, reused = _connect(address, self.deadline.remaining("joining the store"))
        try:
            roster, me = self._roster(store)
        except Unavailable as e:  # a connection kept from a store gone since (a trainer restarted on its address)
            if not reused or not isinstance(e.__cause__, dist.DistError):
                raise
            store = _store(address, False, self.deadline.remaining("joining the store"))
            roster, me = self._roster(store)
        stamp("roster")
        answers = roster.answers
        nbytes, profile = 0, {"roster": time.perf_counter() - self.start}
        try:
            self.trainer = trainer_layout(store, self.offer, self.specs)
            routes = cached_routes(self.trainer, roster_layout(self.specs, roster))
            memories = _memories(store, self.offer, self.trainer.ranks, self.deadline)
            pulled, pushed = pulls.split(routes, memories, roster.facts)
            sources = sorted({t.src for t in pulled.of_receiver(me)})
            held = _held_memories(store, memories, sources, self.deadline) if sources else {}
            profile["plan"] = time.perf_counter() - self.start - profile["roster"]
            if sources:
                nbytes = pulls.pull(pulled, me, self.trainer, held, self.specs, self.staging, self.device, profile,
                                    self.hold)
        except BaseException as e:  # a trainer rank waiting on this rank's pull fails at once, with the reason
            _say(store, _pulled_key(self.offer, me), (str(e) or type(e).__name__).encode())
            raise
        _say(store, _pulled_key(self.offer, me), b"")
        stamp("pulled")
        if any(t.dsts for t in pushed.transfers):
            received = time.perf_counter()
            nbytes += self._receive(store, pushed, me, answers, profile)
            profile["group"] = time.perf_counter() - received
        kept.CONNECTIONS.give(address, store)
        backend = pb.BACKEND_NCCL if self.device.type == "cuda" else pb.BACKEND_GLOO
        return Report(nbytes, time.perf_counter() - self.start, _channels(pulled, pushed, backend, receiver=me),
                      profile=profile)

    def _pull_armed(self) -> Report:
        """Queues the copy of every piece from the held storages (one launch of a kept table) and returns: the
        report names the event after it (Report.copied), which the trainer waits for."""
        profile = {"plan": time.perf_counter() - self.start, "plan.arm": self._arming}
        self._queued = True  # (before the launch: a close() meanwhile lets what it queued end)
        nbytes, _ = self._armed_pull(profile)
        stamp("pulled")
        return Report(nbytes, time.perf_counter() - self.start, {"cuda_ipc": len(self.armed[1])}, profile=profile,
                      copied=record_copied(self.device))

    def keep_ahead(self) -> bool:
        """Armed, before its offer is due: makes what its pull would launch into this staging (the latest launch of
        its layout moved to these storages and this staging: pulls.pull's dry run, on the transfer stream that
        later launches it), copies nothing, and keeps it (rlsync.transfer.relaunch) -> whether it did. For a
        replica told of the trainer's memories (its onload) or woken into a new store before the offer comes."""
        if self.armed is None or self.keep is None:
            return False
        with torch.cuda.stream(transfer_stream(self.device)):  # (what it uploads: before the copies queued there)
            return self._armed_pull(None, dry=True)[1]

    def _armed_pull(self, profile: dict | None, dry: bool = False) -> tuple[int, bool]:
        """pulls.pull of the armed routes, queued on the current stream (`dry`: made, not queued); what it launched
        is kept for the next offer naming the same memories (rlsync.transfer.relaunch) -> (its bytes, whether it
        was kept)."""
        routes, held = self.armed
        launched = {}
        nbytes = pulls.pull(routes, self.rank, self.trainer, held, self.specs, self.staging, self.device, profile,
                            self.hold, wait=False, laid=self._staging_layout(), launched=launched, dry=dry)
        if self.keep is not None and launched:
            relaunch.remember(self.keep, self.offer.routing, self.specs, self.rank, launched, nbytes)
        return nbytes, bool(launched) and self.keep is not None

    def _flat_staging(self, dest: Store) -> tuple[dict[str, tuple[Box, torch.Tensor]], object]:
        """This rank's staging in `dest`, kept in its memo by the manifest's tensors and the boxes (by identity: a
        caller passes the same mapping, unchanged, at each update), and a token of it: a store's views stay where
        they are for as long as it lives, so the token names where the staging lies (kept.writer) without reading
        every tensor's address."""
        key = ("staging", self.rank, _tensors(self.specs))
        found = self._memo.get(key)
        if found is None or found[0] is not self._boxes:  # (boxes, staging, token, its staging_layout once asked)
            staging = _staging(self.specs, dest.views_for(self.specs), self._boxes)  # (under the manifest's names)
            found = self._memo[key] = [self._boxes, staging, object(), None]
        self._flat = found
        return found[1], found[2]

    def _staging_layout(self) -> tuple[tuple, np.ndarray] | None:
        """kept.staging_layout of this rank's staging into a store, kept with it in the store's memo
        (_flat_staging); None into anything else."""
        if self._flat is None:
            return None
        if self._flat[3] is None:
            self._flat[3] = kept.staging_layout(self._flat[1])
        return self._flat[3]

    def _receive(self, store, routes: Routes, me: int, answers: Sequence[pb.Answer], profile: dict) -> int:
        """The pieces that come over the group (every member joins it, with or without pieces of its own)."""
        writer = kept.writer(routes.of_receiver(me), me, self.specs, self.staging, self.device,
                             self.keep,
                             lambda: routed.destinations(routes, me, self.specs, self.staging), self._placed)
        tid, senders = self.offer.transfer_id, self.trainer.ranks
        members = senders + routes.receivers
        gid, pg = routed_groups.take(store, tid, senders + me, members, self.device, self.deadline)
        self._pg = pg
        try:
            nbytes = routed.receive(pg, routes, me, writer, _bucket(self.offer, answers), self.deadline, self.device,
                                    profile)
        except BaseException as e:
            self._pg = None
            routed_groups.release(pg, e)
            del pg
            raise
        self._pg = None
        routed_groups.keep(gid, pg)
        return nbytes

    def _wake_run(self) -> None:
        """close()'s thread: sets this rank's key, which ends run()'s wait at once."""
        try:
            _store(self.offer.routing.store, False, WAKE_SECONDS).set(self._wake, b"closed")
        except (RuntimeError, OSError):  # the store is gone (a DistError): run()'s wait has failed already
            pass

    def close(self) -> None:
        """Ends the transfer from another thread: run() then fails instead of waiting on, and lets go
        of the staging it was to write."""
        with self._lock:
            self._closed, waiting = True, self._waiting
        if waiting:  # on a connection of its own (run()'s is blocked in its wait), off this thread
            threading.Thread(target=self._wake_run, daemon=True, name="rlsync-roster-wake").start()
        if self._queued:  # an armed copy reads the trainer's memory and writes the staging until it ends
            transfer_stream(self.device).synchronize()
        self.staging, self._placed = {}, None  # (no kept writer of the staging is found after this)
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - already gone
                pass
