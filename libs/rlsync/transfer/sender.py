"""The sending end: offers a transfer, then moves the bytes to every receiver that answered."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from rlsync.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from rlsync.address import reachable_host
from rlsync.common.trace import traced
from rlsync.transfer.backends import available, channel
from rlsync.transfer.backends.base import SendJob, expect
from rlsync.transfer.backends.groups import cancel_ahead, start_ahead
from rlsync.transfer.backends.slots import describe_cuda
from rlsync.transfer.control import Conn, Deadline, Listener
from rlsync.transfer.dtypes import dtype_name
from rlsync.transfer.handshake import NAMES, PROTOCOL_VERSION, backend_of, local_facts
from rlsync.transfer.manifest import Spec, from_proto, to_proto
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.messages import Hello, Reject
from rlsync.transfer.plan import cached_plan, plan_buckets
from rlsync.transfer.source import ResidentSource, StreamedSource
from rlsync.transfer.spans import span
from rlsync.transfer.v1 import transfer_pb2 as pb

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass
class Report:
    nbytes: int
    seconds: float  # end to end: from send() to every receiver's confirmation
    backends: dict[str, int]  # backend name -> receiver ranks served
    data_seconds: float = 0.0  # from the first Welcome on (connections and handshakes excluded)
    profile: dict[str, float] = field(default_factory=dict)  # seconds per stage (see WeightSender.send)
    wire_bytes: int = 0  # payload bytes sent, summed over backends: below nbytes when deltas went out
    copied: bytes = b""  # a pull answered before its copy completed: the CUDA IPC event after it
    rank_bytes: list[int] = field(default_factory=list)  # a routed transfer: payload bytes each trainer rank sent

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def data_gbps(self) -> float:
        return self.nbytes / self.data_seconds / 1e9 if self.data_seconds > 0 else 0.0


class WeightSender:
    """Publishes a fixed set of named tensors (their current values at each send).

        sender = WeightSender(model_state, checksums=True)
        offer = sender.offer(version=step)          # give to each receiver (e.g. over gRPC)
        sender.send(offer, answers, timeout=120)     # answers: what each receiver replied

    `tensors` is a mapping of whole tensors, or a source (rlsync.transfer.source) whose tensors are
    produced while the transfer runs (cast or fused on the fly). Every offer has a new
    transfer id and single-use token. One-copy is used (unless one_copy=False) when the tensors
    already live in memory a receiver can map: any contiguous CUDA tensors, or CPU tensors
    allocated from `arena`.

    delta=True (resident tensors): the sender keeps a copy of the bytes it last sent, and a
    broadcast group (gloo, nccl) whose every receiver answered that it holds that version gets,
    per bucket, only the words that changed when that is smaller (rlsync.transfer.delta), verified
    bit for bit against the new bytes' checksums; a bucket a receiver rebuilt wrong is sent again
    whole. The copy costs the model's size again, on the sender's device.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor] | ResidentSource | StreamedSource, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 host: str = "127.0.0.1", advertise: str | None = None, checksums: bool = False,
                 arena: SharedArena | None = None, backends: list[str] | None = None,
                 one_copy: bool | None = None, delta: bool = False):
        plan_buckets([], bucket_bytes)  # refuses a bad bucket size now, not at send time
        self.source = tensors if isinstance(tensors, (ResidentSource, StreamedSource)) else ResidentSource(tensors)
        if delta and not isinstance(self.source, ResidentSource):
            raise InvalidArgument("delta updates need resident tensors (a streamed source is produced once per pass, "
                                  "so a bucket rebuilt wrong could not be sent again)")
        self.delta = delta
        self._base: torch.Tensor | None = None  # delta: the bytes last sent, in manifest order ...
        self._base_version: int | None = None  # ... and their version
        self.device = self.source.device
        self.bucket_bytes = bucket_bytes
        self.checksums = checksums
        self.arena = arena if arena is not None else self.source.arena
        self.allow_one_copy = one_copy is not False  # None: whenever the memory allows it
        # Where receivers dial: the bind host, or this host's address when bound to every interface.
        self.host = advertise or reachable_host(host)
        self.listener = Listener(host, self.host)
        self.cache: dict = {}
        self._specs: dict[str, list[Spec]] = {}  # transfer id -> specs of its manifest (the latest few)
        offered = available()
        if self.device.type != "cuda":
            offered -= {pb.BACKEND_CUDA_IPC, pb.BACKEND_NCCL}
        if backends is not None:
            offered &= {backend_of(b) for b in backends}
        self.backends = [b for b in NAMES if b in offered]

    def _one_copy(self) -> bool:
        if not self.allow_one_copy or not isinstance(self.source, ResidentSource):
            return False  # streamed tensors exist one at a time: nothing stays put for a receiver to map
        if self.device.type == "cuda":
            return self.source.contiguous
        tensors = [t for t in self.source.tensors.values() if t.numel()]
        return self.arena is not None and all(self.arena.locate(t) is not None for t in tensors)

    def offer(self, version: int, pull: bool = False) -> pb.Offer:
        """pull: also say where the CUDA tensors lie, so same-GPU receivers copy them themselves.
        The caller must then keep them unchanged and allocated until those receivers are done."""
        specs = self.source.specs(self.checksums)
        transfer_id = uuid.uuid4().hex
        self._specs[transfer_id] = specs
        while len(self._specs) > 4:
            self._specs.pop(next(iter(self._specs)))
        one_copy = self._one_copy()
        manifest = to_proto(specs, version, self.source.format)
        if self.source.adapter is not None:
            manifest.adapter.CopyFrom(self.source.adapter)
        return pb.Offer(
            protocol_version=PROTOCOL_VERSION, manifest=manifest, facts=local_facts(self.device),
            backends=self.backends, token=secrets.token_hex(16), control_address=self.listener.address,
            local_control=self.listener.local_name, bucket_bytes=self.bucket_bytes, one_copy=one_copy,
            transfer_id=transfer_id, mapped=self._mapped() if pull else None, post_ahead=not self.delta)

    def _mapped(self) -> pb.MappedTensors | None:
        """Where the CUDA tensors lie, for receivers on this GPU to pull them (cuda_ipc)."""
        regions = self.regions()
        if regions is not None:
            torch.cuda.synchronize(self.device)  # no kernel of the trainer may still be writing them
        return regions

    def regions(self) -> pb.MappedTensors | None:
        """A handle per CUDA storage, and the region and offset of every tensor in them, for
        receivers on this GPU to map; None when they cannot (not CUDA, cuda_ipc not offered,
        tensors not in place). It holds until the tensors move (the trainer offloads). A source that
        casts whole tensors (StreamedSource.originals) describes those, with their dtypes: a receiver
        casts as it copies."""
        if self.device.type != "cuda" or pb.BACKEND_CUDA_IPC not in self.backends or not self.allow_one_copy:
            return None
        originals = self.source.originals if isinstance(self.source, StreamedSource) else None
        specs = self.source.specs() if originals is not None else []
        if self._one_copy():
            tensors, dtypes = list(self.source.tensors.values()), []  # the addresses of resident()
        elif originals is not None and all(t.is_cuda and t.shape == s.shape for t, s in zip(originals, specs)):
            tensors = originals  # (parameters: offloaded ones have no shape, and are not described)
            cast = any(t.dtype != s.dtype for t, s in zip(tensors, specs))
            dtypes = [dtype_name(t.dtype) for t in tensors] if cast else []
        else:
            return None
        described = describe_cuda(tensors, self.cache)
        regions, offsets = zip(*described["locations"]) if described["locations"] else ((), ())
        return pb.MappedTensors(ipc=described["ipc"], region=regions, offset=offsets, dtype=dtypes)

    def send_ahead(self, offer: pb.Offer) -> bool:
        """Starts broadcasting `offer` before any receiver answered, on the NCCL group of the last
        transfer when its plan was this one's (rlsync.transfer.backends.groups): receivers that
        posted their receives get the bytes at once, and the others' answers come meanwhile.
        send() of this offer then waits for it, or aborts it when its receivers are not that
        group's; the next send_ahead(), send() or close() ends one no send() took. -> whether it started
        (not with checksums or deltas, nor for tensors not resident and contiguous per bucket)."""
        if not self.can_send_ahead:
            return False
        resident = self.source.resident()

        def views_of(plan) -> list:
            return [span([resident[s.tensor][s.src:s.src + s.length] for s in b.slices]) for b in plan]

        return start_ahead(self.cache, offer.transfer_id, tuple(s.nbytes for s in self._specs_of(offer)),
                           offer.bucket_bytes, views_of)

    @property
    def can_send_ahead(self) -> bool:
        """Whether send_ahead() may do anything: post on a group an earlier send left, or end what it
        posted before (a sender whose receivers all pulled has neither: its caller need not queue it)."""
        return not (self.checksums or self.delta) and isinstance(self.source, ResidentSource) and \
            any(k == "ahead" or k[:1] == ("group",) for k in list(self.cache))

    def sent_ahead(self, transfer_id: str) -> bool:
        """Whether broadcasts send_ahead() started for this transfer wait for a send() to take them."""
        ahead = self.cache.get("ahead")
        return ahead is not None and ahead.transfer_id == transfer_id

    def cancel_ahead(self, transfer_id: str) -> None:
        """Ends what send_ahead() started for this transfer, if no send() took it."""
        cancel_ahead(self.cache, transfer_id)

    def send(self, offer: pb.Offer, answers: list[pb.Answer], timeout: float = 300.0) -> Report:
        """Moves the tensors to every answering receiver; returns once all confirmed receipt.
        Receivers that pulled (their answer says so) already hold them: nobody waits for them."""
        deadline = Deadline(timeout, f"transfer {offer.transfer_id[:8]} (version {offer.manifest.version})")
        try:
            expected = {key: a for key, a in self._check_answers(offer, answers).items() if not a.pull}
            answers = [a for a in answers if not a.pull]
            start = time.perf_counter()
            conns = self._gather(offer, expected, deadline)
            gathered = time.perf_counter()
            try:
                with traced("send"):
                    reported, wire = self._run_groups(offer, answers, conns, deadline)
            finally:
                for conn, _ in conns:
                    conn.close()
        finally:
            cancel_ahead(self.cache)  # broadcasts posted ahead that no group of this send took
        if self.delta:
            self._keep_base(offer.manifest.version)
        end = time.perf_counter()
        by_backend: dict[str, int] = defaultdict(int)
        for a in answers:
            by_backend[NAMES[a.backend]] += a.ranks
        # The profile: sender stages, then each receiver stage at its slowest receiver.
        profile = {"connect": gathered - start, "data": end - gathered}
        for stages in reported:
            for stage, seconds in stages.items():
                key = f"receiver_{stage}"
                profile[key] = max(profile.get(key, 0.0), seconds)
        return Report(sum(s.nbytes for s in self._specs_of(offer)), end - start, dict(by_backend), end - gathered,
                      profile, wire)

    def _keep_base(self, version: int) -> None:
        """Delta mode, after every receiver confirmed: the bytes just sent become the base."""
        tensors = self.source.resident()
        total = sum(t.numel() for t in tensors)
        if self._base is None or self._base.numel() != total:
            self._base = torch.empty(total, dtype=torch.uint8, device=self.device)
        offset = 0
        for t in tensors:
            self._base[offset:offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        self._base_version = version

    def _delta_base(self, backend: int, answers: list[pb.Answer]) -> torch.Tensor | None:
        """The base a broadcast group can take deltas against: only when every one of its receivers
        holds the version the base is."""
        if self._base is None or backend not in (pb.BACKEND_GLOO, pb.BACKEND_NCCL):
            return None
        if all(a.delta and a.base_version == self._base_version for a in answers):
            return self._base
        return None

    def _specs_of(self, offer: pb.Offer) -> list[Spec]:
        return self._specs.get(offer.transfer_id) or from_proto(offer.manifest)

    def _check_answers(self, offer: pb.Offer, answers: list[pb.Answer]) -> dict[tuple[str, int], pb.Answer]:
        expected = {}
        for a in answers:
            if a.transfer_id != offer.transfer_id:
                raise InvalidArgument(f"answer from {a.receiver_id!r} is for transfer {a.transfer_id!r}, "
                                      f"not {offer.transfer_id!r}: pass the answers to this offer")
            if a.backend not in offer.backends:
                raise FailedPrecondition(f"{a.receiver_id!r} chose {NAMES.get(a.backend, a.backend)}, "
                                         "which this offer does not include")
            if a.pull and not len(offer.mapped.ipc):
                raise FailedPrecondition(f"{a.receiver_id!r} says it pulled, but this offer describes no memory to "
                                         "pull from: answer it anew")
            if a.ranks < 1:
                raise InvalidArgument(f"{a.receiver_id!r} answered with {a.ranks} ranks; at least 1 is needed")
            for rank in range(a.ranks):
                if (a.receiver_id, rank) in expected:
                    raise InvalidArgument(f"receiver id {a.receiver_id!r} appears twice among the answers")
                expected[(a.receiver_id, rank)] = a
        return expected

    def _gather(self, offer: pb.Offer, expected: dict, deadline: Deadline) -> list[tuple[Conn, Hello]]:
        """Accepts the receivers' connections; strays and wrong tokens are turned away."""
        conns: dict[tuple[str, int], tuple[Conn, Hello]] = {}
        while len(conns) < len(expected):
            missing = sorted(set(expected) - set(conns))
            doing = f"waiting for {len(missing)} receiver rank(s) to connect, e.g. {missing[0][0]!r}"
            conn = self.listener.accept(deadline, doing)
            try:
                hello, _ = expect(conn, Hello, Deadline(min(10.0, deadline.remaining(doing)), "handshake"), "hello")
            except Exception:  # noqa: BLE001 - a stray or broken connection must not end the transfer
                conn.close()
                continue
            refusal = self._refuse(offer, hello, expected, conns)
            if refusal:
                try:
                    conn.send(refusal)
                except Exception:  # noqa: BLE001 - a stray from an aborted transfer may be gone already
                    pass
                conn.close()
                continue
            conns[(hello.receiver_id, hello.rank)] = (conn, hello)
        return list(conns.values())

    @staticmethod
    def _refuse(offer: pb.Offer, hello: Hello, expected: dict, conns: dict) -> Reject | None:
        if hello.protocol != PROTOCOL_VERSION:
            return Reject(f"protocol mismatch: sender {PROTOCOL_VERSION}, receiver {hello.protocol}",
                          "FailedPrecondition")
        if hello.transfer_id != offer.transfer_id:
            return Reject(f"this sender is running transfer {offer.transfer_id}, not {hello.transfer_id}: "
                          "the offer you hold is stale; ask for a new one", "FailedPrecondition")
        if not secrets.compare_digest(hello.token, offer.token):
            return Reject("wrong transfer token: use the token of the Offer for this transfer",
                          PermissionDenied.__name__)
        key = (hello.receiver_id, hello.rank)
        if key not in expected:
            return Reject(f"receiver {hello.receiver_id!r} rank {hello.rank} is not among the answers of this "
                          "transfer", "FailedPrecondition")
        if key in conns:
            return Reject(f"receiver {hello.receiver_id!r} rank {hello.rank} is already connected", "AlreadyExists")
        return None

    def _run_groups(self, offer: pb.Offer, answers: list[pb.Answer], conns: list[tuple[Conn, Hello]],
                    deadline: Deadline) -> tuple[list[dict[str, float]], int]:
        """Runs each backend's share; returns every receiver's stage profile. Resident tensors go to all
        backends at once; a streamed source makes one pass per backend, one backend after another (a
        pass may be a collective of the trainer's ranks, which must all walk the same sequence)."""
        specs = self._specs_of(offer)
        resident = self.source.resident()
        sizes = tuple(s.nbytes for s in specs)
        groups: dict[int, list[tuple[Conn, Hello]]] = defaultdict(list)
        for conn, hello in conns:
            groups[hello.backend].append((conn, hello))
        jobs = []
        for backend, members in groups.items():
            ids = {h.receiver_id for _, h in members}
            mine = [a for a in answers if a.receiver_id in ids]
            bucket = min([a.bucket_bytes or offer.bucket_bytes for a in mine])
            jobs.append((channel(backend), SendJob(
                conns=members, specs=specs, sources=resident, plan=list(cached_plan(sizes, bucket)),
                bucket_bytes=bucket, verify=self.checksums, deadline=deadline, device=self.device,
                store_host=self.host, transfer_id=offer.transfer_id, one_copy=offer.one_copy and (
                    backend == pb.BACKEND_CUDA_IPC or backend == pb.BACKEND_SHM and self.device.type != "cuda"),
                arena=self.arena, cache=self.cache,
                delta_base=self._delta_base(backend, mine))))
        if resident is None:
            for chan, job in jobs:
                with self.source.stream() as job.sources:  # a pass left part way is finished: peers wait in it
                    chan.send(job)
        else:
            _concurrently(jobs)
        wire = sum(sum(sizes) if job.wire_bytes is None else job.wire_bytes for _, job in jobs)
        return [stages for _, job in jobs for stages in job.reported], wire

    def close(self) -> None:
        self.listener.close()
        values = list(self.cache.values())  # emptied first: a thread ending broadcasts sent ahead may pop one
        self.cache.clear()
        for value in values:
            if hasattr(value, "close"):
                value.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _concurrently(jobs: list) -> None:
    """Runs each (channel, job) at once, the first in this thread; raises the first failure."""
    errors: list[BaseException] = []

    def run(chan, job):
        try:
            chan.send(job)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=job) for job in jobs[1:]]
    for t in threads:
        t.start()
    if jobs:
        run(*jobs[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
