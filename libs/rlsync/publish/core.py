"""The trainer's half of a weight sync, over any source: offer, publish, checksums, offload/onload.

rlsync's trainer service and a user's own loop (WeightPublisher) both answer the coordinator
through this class; they differ only in *where* the work runs (`run`): in a thread under the
trainer's lock, or at the publish points of a loop whose ranks must all take part.
"""

from __future__ import annotations

import asyncio
import logging
import itertools
from collections.abc import Awaitable, Callable

import torch

from rlsync.common.stamps import stamp
from rlsync.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rlsync.publish.buffer import PublishBuffer
from rlsync.publish.ranks import AUDIT, DESCRIBE, MEMORY, OFFLOAD, ONLOAD, PASSES, ROUTED, PublishPoints, Ranks
from rlsync.publish.quantized import QuantizedBuffer, quantized
from rlsync.publish.source import ShardedModule
from rlsync.quant.fp8_format import same_format, stacked
from rlsync.transfer import Report, WeightSender, audit_entry
from rlsync.transfer.checksum import from_sums
from rlsync.transfer.dtypes import dtype_name, dtype_of
from rlsync.transfer.handshake import local_facts
from rlsync.transfer.pulls import same_gpu
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.sharded import ShardedSender
from rlsync.transfer.source import ResidentSource, StreamedSource
from rlsync.transfer.v1 import transfer_pb2 as tpb

log = logging.getLogger(__name__)

Source = ResidentSource | StreamedSource | ShardedModule
#: run(fn, op, passes, payload) -> fn's result, run where the trainer allows it (on every rank: the
#: others get op, passes and payload).
Runner = Callable[..., Awaitable[object]]
Audit = dict[str, tuple[str, tuple[int, ...], str]]


def in_thread(lock: asyncio.Lock) -> Runner:
    """For a single-process trainer: the work runs in a thread while `lock` keeps training out."""
    async def run(fn, op=PASSES, passes=0, payload=b""):
        async with lock:
            return await asyncio.to_thread(fn)
    return run


def at_publish_points(points: PublishPoints) -> Runner:
    """For a user's loop (any number of ranks): the work waits for the loop's next publish point."""
    async def run(fn, op=PASSES, passes=0, payload=b""):
        return await asyncio.wrap_future(points.submit(fn, op, passes, payload))
    return run


class PublisherCore:
    """`source(stacked)` makes what is sent: fused experts parameters stacked when `stacked` (the replicas take
    them so: WeightFormat.stacked_experts), else per expert under the checkpoint's names."""

    def __init__(self, source: Callable[[bool], Source], run: Runner, *, bucket_bytes: int, host: str = "127.0.0.1",
                 advertise: str | None = None, checksums: bool = False, transfer_timeout: float = 300.0,
                 offload: Callable[[], None] | None = None, onload: Callable[[], None] | None = None,
                 delta: bool = False, sharded: bool = False, publish_buffer: bool = False):
        self.source, self.run = source, run
        self.publish_buffer = publish_buffer  # offers that are no pull copy the weights into one first
        self._buffer: PublishBuffer | None = None
        self._no_buffer = ""  # why there is none (logged once, until the sender is made again)
        self.delta = delta  # see WeightSender: resident sources only
        self.sharded = sharded  # a sharded model (ShardedModule): routed sends, audits by checksum shares
        self.bucket_bytes, self.host, self.advertise = bucket_bytes, host, advertise
        self.checksums_in_manifest, self.transfer_timeout = checksums, transfer_timeout
        self.hooks = {OFFLOAD: offload, ONLOAD: onload}
        self.offloaded = False
        self.published = 0  # the last version published (or offered for receivers to pull)
        self.current = 0  # the version the weights are now (an offer without a version gets it)
        self._sender: WeightSender | ShardedSender | None = None
        self._source: Source | None = None  # what the sender sends (and audits read)
        self._offers: dict[str, tuple[tpb.Offer, WeightSender | ShardedSender]] = {}  # id -> offer, its sender
        self._final: dict[str, torch.cuda.Event] = {}  # id -> recorded as a GPU offer was made (`final`)
        self._started: dict[str, tuple[asyncio.Task, list[bytes]]] = {}  # id -> a send begun early, its answers
        self._running: set[asyncio.Task] = set()
        self.ranks: Ranks | None = None  # a sharded trainer's ranks: each sends its own shards
        self.format: tpb.WeightFormat | None = None  # what the replicas hold (quantized on the way out), if any

    def _require_on_device(self, action: str) -> None:
        if self.offloaded:
            raise FailedPrecondition(f"trainer is offloaded: call Onload before {action}")

    def use_format(self, fmt: tpb.WeightFormat | None) -> None:
        """The format the next offers publish in (the replicas' engine chose it): a new one makes a new
        sender, whose source quantizes those tensors on the way out (rlsync.publish.quantized), or sends
        fused experts parameters stacked."""
        fmt = fmt if fmt is not None and (fmt.HasField("fp8") or stacked(fmt)) else None
        if not same_format(fmt, self.format) or stacked(fmt) != stacked(self.format):
            self.drop_sender()
            self.format = fmt

    def _sender_now(self) -> WeightSender | ShardedSender:
        if self._sender is None:
            source = self.source(stacked(self.format))
            if self.format is not None and self.format.HasField("fp8"):  # (a sharded model's ranks: what they hold)
                source = quantized(source, self.format)
            elif self.format is not None and isinstance(source, ShardedModule):
                source.format = self.format  # (its manifest says so: the other ranks send alike)
            if isinstance(source, ShardedModule):  # every rank sends its own shards
                if self.delta:
                    raise InvalidArgument("delta updates need resident tensors: a sharded model's ranks each send "
                                          "their own shards, and keep no copy of what they sent")
                if self.checksums_in_manifest:
                    raise InvalidArgument("per-tensor checksums in the manifest are not sent by a sharded model's "
                                          "ranks (each holds part of every tensor): verify the sync instead "
                                          "(SyncWeights verify), which adds up every rank's checksum share")
                self._sender = source.sender(bucket_bytes=self.bucket_bytes, host=self.host, advertise=self.advertise)
            else:
                self._sender = WeightSender(source, bucket_bytes=self.bucket_bytes, host=self.host,
                                            advertise=self.advertise, checksums=self.checksums_in_manifest,
                                            delta=self.delta)
            self._source = source
        return self._sender

    def _buffer_now(self, sender: WeightSender) -> PublishBuffer | None:
        """The publish buffer, made at the first offer that is no pull; None without one: not asked
        for, or it cannot be had (logged once): delta updates, weights that are not resident,
        contiguous CUDA tensors offered over cuda_ipc, or no GPU memory left for the copy. The
        updates are then published from the weights themselves, under the trainer's lock."""
        if not self.publish_buffer or self._no_buffer:
            return None
        if self._buffer is None:
            why = _why_no_buffer(sender, self.delta)
            if not why:
                try:
                    self._buffer = PublishBuffer(sender.source, lambda source: WeightSender(
                        source, bucket_bytes=self.bucket_bytes, host=self.host, advertise=self.advertise,
                        checksums=self.checksums_in_manifest))
                except torch.OutOfMemoryError as e:
                    why = f"no room on the GPU for a copy of the weights ({str(e).splitlines()[0]})"
            if why:
                self._no_buffer = why
                log.warning("no publish buffer: %s; updates are published from the weights themselves", why)
        return self._buffer

    def pass_source(self, rank: int) -> Source:
        """What a rank's passes walk (a streamed source's; a sharded model makes none): rank 0 the
        source its sender reads, the other ranks a source of their own."""
        return self.source_kind() if rank == 0 else self.source(stacked(self.format))

    def drop_sender(self) -> None:
        """Forgets the sender and its offers (the parameters' memory is about to move)."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        self._no_buffer = ""  # memory may be free when the weights come back
        if self._sender is not None:
            self._sender.close()
            self._sender = None
            self._offers.clear()
            self._final.clear()
        self._source = None  # (a quantized stage's FP8 buffers and scales go with it: the GPU is the engine's now)

    def _passes(self, per_send: int) -> int:
        """Passes a request makes over a streamed source (none over a resident one, nor a sharded
        model's: its ranks each send their own shards). Asked on the thread that runs the request,
        when the model is at rest between steps."""
        sender = self._sender_now()
        return per_send if isinstance(sender, WeightSender) and isinstance(sender.source, StreamedSource) else 0

    # ---- what the coordinator calls ---------------------------------------------------------------
    # Each request checks the state and builds the sender inside the work `run` schedules: by then an
    # offload queued before it has happened, and a sharded model is not in the middle of a step.
    async def offer(self, version: int, pull: bool = False, describe: bool = False, fmt: tpb.WeightFormat | None = None
                    ) -> tuple[tpb.Offer, tuple[tpb.MappedTensors, tpb.Facts] | None]:
        """pull: receivers on the trainer's GPU copy the weights themselves (see OfferWeightsRequest);
        else, with a publish buffer, the weights are copied into it and the offer is a pull of the
        buffer, which receivers copy while training goes on. describe: also where the weights (or
        the buffer) lie on the GPU, for replicas on it to keep mapped (see onload); None when they
        cannot be mapped. fmt: the format the replicas hold (quantized on the way out; None: as it trains).
        A sharded model's offer with describe names every rank's memory as it is now (Routing.memories): replicas
        that hold it copy at once."""
        if describe and self.sharded and (self._sender is None or self._sender.device.type == "cuda"):
            payload = fmt.SerializeToString() if fmt is not None else b""
            return await self.run(lambda: self._offer_described(version, payload), MEMORY, 0, payload), None

        def offer() -> tuple[tpb.Offer, tuple[tpb.MappedTensors, tpb.Facts] | None]:
            self._require_on_device("publishing weights")
            self.use_format(fmt)
            sender = self._sender_now()
            if isinstance(self._source, QuantizedBuffer):
                self._source.refresh()  # what this offer sends: the weights now, quantized
            if isinstance(sender, ShardedSender):
                offer = sender.offer(version)
                self._remember(offer, sender)
                return offer, None
            buffer = None if pull else self._buffer_now(sender)  # a caller that keeps it still needs none
            if buffer is not None:
                buffer.refresh()
                # what older offers of the buffer described is gone: publishing one now is refused
                self._offers = {k: v for k, v in self._offers.items() if v[1] is not buffer.sender}
            made = buffer.sender if buffer is not None else sender
            offer = made.offer(version, pull or buffer is not None)
            # a pull's offer already says where the weights lie
            regions = (offer.mapped if offer.mapped.ipc else made.regions()) if describe else None
            self._remember(offer, made)  # here, in step with an offload's drop_sender
            return offer, None if regions is None else (regions, local_facts(made.device))

        return await self.run(offer, PASSES, lambda: self._passes(1 if self.checksums_in_manifest else 0))

    def _offer_described(self, version: int, payload: bytes) -> tpb.Offer:
        """Rank 0: a sharded model's offer naming every rank's memory (describe_memory), when each can say."""
        memories = self.describe_memory(payload)
        sender = self._sender_now()
        offer = sender.offer(version)
        offer.routing.memories.extend(memories)
        self._remember(offer, sender)
        return offer

    def describe_memory(self, payload: bytes) -> list[str]:
        """Every rank of a sharded model, in step, as rank 0 makes an offer for replicas that may hold the weights:
        where this rank's storages lie (ShardedSender.describe), gathered on rank 0, then the weights as they are
        now in them (a quantized model's values and scales) -> (rank 0) every rank's digest, [] when one cannot
        say (the replicas then meet the ranks at the send). `payload`: the format rank 0 offers in
        (WeightFormat). A rank that cannot send fails rank 0's offer, as a send would."""
        ranks = self.ranks or Ranks()
        sender, error = None, None
        try:
            self._require_on_device("publishing weights")
            self.use_format(tpb.WeightFormat.FromString(payload))
            sender = self._sender_now()
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below (it is the agreement too)
            error = e
        every = self._gather_memory(ranks, sender, error)
        digests = self._keep_memory(ranks, sender, every)  # (whatever follows: the store keeps what ranks described)
        failed = next(((r, d.error) for r, d in enumerate(every) if d.error), None)
        if failed is not None:
            if ranks.rank != 0:
                return []
            raise error or Unavailable(f"trainer rank {failed[0]} cannot send its shards: {failed[1]}")
        refreshed = True
        try:
            self._source.refresh(ranks)  # (every rank, in step: a quantized model's scales are exchanged)
        except Exception as e:  # noqa: BLE001 - the send refreshes again
            log.warning("rank %d cannot bring what it sends up to date: %s", ranks.rank, e)
            refreshed = False
        # (alike on every rank) a quantized model's ranks agree that their values are final on their GPUs, as a
        # replica's armed copy may start once rank 0 rings; one rank's refresh may fail after the exchange
        if self._source.format is not None and ranks.agree(refreshed):
            return []
        return digests if refreshed else []

    @staticmethod
    def _gather_memory(ranks: Ranks, sender: ShardedSender | None, error: Exception | None) -> list[tpb.RankDigest]:
        """Every rank of a sharded model, in step: where its storages lie (ShardedSender.describe), or why it cannot
        send (`error`), gathered on every rank in rank order."""
        mine = tpb.RankDigest(error=str(error) or type(error).__name__) if error is not None else tpb.RankDigest()
        if error is not None:
            log.warning("rank %d cannot send its shards: %s", ranks.rank, error)
        elif sender is not None:
            try:
                mine = sender.describe()
            except Exception as e:  # noqa: BLE001 - the replicas meet this rank at the send instead
                log.warning("rank %d cannot say where its weights lie: %s", ranks.rank, e)
        return [tpb.RankDigest.FromString(d) for d in ranks.gather(mine.SerializeToString())]

    @staticmethod
    def _keep_memory(ranks: Ranks, sender: ShardedSender | None, every: list[tpb.RankDigest]) -> list[str]:
        """Every rank of a sharded model, in step, with `every` rank's memory gathered: rank 0 puts what the store
        lacks of it (ShardedSender.described), and when some rank described new memory, the ranks agree that it
        is there before each counts on it (ShardedSender.stored: its sends put it no more; one that cannot count
        on it puts it at its next send) -> (rank 0) every rank's digest, [] when one cannot say or the put
        failed."""
        digests, put = [], ranks.rank != 0
        if ranks.rank == 0 and sender is not None:
            try:
                digests, put = sender.described(every), True
            except Exception as e:  # noqa: BLE001 - the ranks' next sends put it; the replicas meet them there
                log.warning("cannot keep the ranks' memory in the store: %s", e)
        if any(d.mapped for d in every) and ranks.agree(put) == 0 and sender is not None:  # (alike on every rank)
            sender.stored(every)
        return digests

    def settled(self, transfer_id: str) -> None:
        """Every replica rung with a sharded model's offer copied it as it prepared (answered as pulls): published
        to them (a replica prepared otherwise may still be sent it)."""
        offer, sender = self._offers.get(transfer_id, (None, None))
        if isinstance(sender, ShardedSender):
            self.published = offer.manifest.version
            sender.settled(offer)

    async def send_ahead(self, transfer_id: str) -> bool:
        """Starts broadcasting an offer before its receivers answered, for a caller that publishes it
        as soon as they did (WeightSender.send_ahead; `cancel_ahead` otherwise). -> whether it started."""
        offer, sender = self._offers.get(transfer_id, (None, None))
        if not isinstance(sender, WeightSender) or not sender.can_send_ahead:
            return False
        return await self.run(lambda: sender.send_ahead(offer))

    def cancel_ahead(self, transfer_id: str) -> None:
        """Ends the broadcasts send_ahead() started, for an offer that will not be published now (called once
        send_ahead() returned): off the event loop, as an NCCL group's abort may take a while, and at once,
        not at the trainer's next turn (self.run): posted broadcasts wait on the GPU, and under CUDA's lazy
        loading a first launch of a kernel in this process would wait behind them. (A send() of another
        transfer may run meanwhile: whichever takes the sender's broadcasts first ends them.)"""
        _, sender = self._offers.get(transfer_id, (None, None))
        if isinstance(sender, WeightSender) and sender.sent_ahead(transfer_id):
            self._background(asyncio.to_thread(sender.cancel_ahead, transfer_id))

    def _background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._running.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._running.discard)
        task.add_done_callback(_retrieved)

    def _remember(self, offer: tpb.Offer, sender: WeightSender | ShardedSender) -> None:
        self._offers[offer.transfer_id] = offer, sender
        if sender.device.type == "cuda" and (offer.mapped.ipc or offer.routing.memories):  # rung by a bell (`final`)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(sender.device))
            self._final[offer.transfer_id] = event
        if offer.mapped.ipc:  # receivers pull it from here, with no PublishWeights
            self.published = offer.manifest.version
        while len(self._offers) > 8:
            self._offers.pop(next(iter(self._offers)))
        self._final = {k: v for k, v in self._final.items() if k in self._offers}

    def final(self, transfer_id: str) -> torch.cuda.Event | None:
        """An event recorded on the GPU as the offer `transfer_id` was made, after its weights: once it has passed,
        they are final there, whatever the trainer queued since (a bell is written after it: ring_bell)."""
        return self._final.get(transfer_id)

    def publish_now(self, transfer_id: str, answers: list[tpb.Answer], timeout: float = 0) -> None:
        """Starts publish() at once, for a caller that will ask for its result (publish() with the
        same answers): the trainer has every answer when it prepared every replica itself."""
        task = asyncio.ensure_future(self._publish(transfer_id, answers, timeout))
        self._background(task)
        self._started[transfer_id] = task, _answered(answers)
        while len(self._started) > 8:  # never asked for: it ends by itself
            self._started.pop(next(iter(self._started)))

    async def publish(self, transfer_id: str, answers: list[tpb.Answer], timeout: float = 0) -> tuple[int, Report]:
        started = self._started.get(transfer_id)
        if started is not None and started[0].cancelled():  # its caller gave up: send again, as then
            del self._started[transfer_id]
            started = None
        if started is None:
            return await self._publish(transfer_id, answers, timeout)
        task, answered = started
        if _answered(answers) != answered:
            raise FailedPrecondition(f"transfer {transfer_id[:8]} is already being sent to what OfferWeights' publish "
                                     f"rang ({sorted(a.receiver_id for a in answers)} answered otherwise): publish it "
                                     "to those answers, or make a new offer")
        # A caller that gives up cancels it, as it would a send of its own: the trainer's lock goes at once
        # (the thread sending runs on until its receivers fail it), so a retry with the survivors need not wait.
        return await task

    async def _publish(self, transfer_id: str, answers: list[tpb.Answer], timeout: float = 0) -> tuple[int, Report]:
        offer, sender = self._offers.get(transfer_id, (None, None))
        if offer is None:
            raise NotFound(f"no offer {transfer_id!r} (expired, or the trainer offloaded since): call OfferWeights")
        if not answers:
            raise InvalidArgument("PublishWeights needs at least one answer (from PrepareUpdate)")

        def send() -> Report:
            self._require_on_device("publishing weights")
            if transfer_id not in self._offers:  # an offload dropped the sender that made it
                raise NotFound(f"offer {transfer_id!r} was dropped when the trainer offloaded: call OfferWeights")
            return sender.send(offer, answers, timeout or self.transfer_timeout)  # (it ends a send_ahead())

        if offer.HasField("routing"):  # every rank sends its own shards (the others get the same request)
            timeout = timeout or self.transfer_timeout
            payload = tpb.RoutedSend(offer=offer, answers=answers, timeout_seconds=timeout).SerializeToString()
            stamp("queued")
            report = await self.run(lambda: self.send_routed(payload), ROUTED, 0, payload)
        else:  # a streamed source makes one pass per channel (receivers that pulled need none)
            pushed = {a.backend for a in answers if not a.pull}
            try:
                report = await self.run(send, PASSES, lambda: self._passes(len(pushed)))
            except BaseException:  # cancelled before send() ran, say: broadcasts it would have ended
                self.cancel_ahead(transfer_id)
                raise
        self._offers.pop(transfer_id, None)
        self.published = offer.manifest.version
        stamp("published")
        return offer.manifest.version, report

    async def checksums(self, dtype: str = "") -> Audit:
        """{name: (dtype, shape, checksum)} of what would be sent now, cast to `dtype` when given (weights kept
        quantized, QuantizedBuffer: what the last offer quantized, which replicas may still be reading)."""
        target = dtype_of(dtype) if dtype else None

        def audit() -> Audit:
            self._require_on_device("GetWeightChecksums")
            out = {}
            source = self.source_kind()
            with torch.no_grad():  # a LoRA adapter's audit covers its frozen base too: the whole policy served
                for name, t in itertools.chain(source.items(), source.frozen.items()):
                    t = t.detach()
                    cast = target is not None and t.is_floating_point() and name not in source.quantized
                    out[name] = audit_entry(t.to(target) if cast else t)
            return out

        if self.sharded:  # every rank adds its share; nothing is gathered (of the tensors in the format sent)
            payload = tpb.AuditShares(dtype=dtype, format=self.format).SerializeToString()
            return await self.run(lambda: self.audit_shares(payload), AUDIT, 0, payload)
        return await self.run(audit, PASSES, lambda: self._passes(1))

    def source_kind(self) -> Source:
        """The source the sender sends (built if need be)."""
        self._sender_now()
        return self._source

    def audit_shares(self, payload: bytes) -> Audit:
        """Every rank of a sharded trainer: its share of each tensor's checksum; the ranks add them up
        (see RankShards.checksum_share). `payload`: an AuditShares (the dtype to cast to, the format rank 0
        publishes in): every rank audits the same tensors."""
        ranks = self.ranks or Ranks()
        if ranks.agree(not self.offloaded):  # every rank refuses alike: none waits for the others' shares
            if ranks.rank != 0:
                return {}
            self._require_on_device("GetWeightChecksums")
        request = tpb.AuditShares.FromString(payload)
        target = dtype_of(request.dtype) if request.dtype else None
        self.use_format(request.format if request.HasField("format") else None)
        module = self.source_kind()
        module.refresh(ranks)  # (every rank, in step: a quantized model's scales are exchanged)
        shares = module.shards.checksum_share(target)
        totals = ranks.add_up([v for pair in shares for v in pair])
        out = {}
        for i, spec in enumerate(module.specs):
            cast = target is not None and spec.dtype.is_floating_point and spec.name not in module.quantized
            dtype = target if cast else spec.dtype
            nbytes = spec.nbytes // spec.dtype.itemsize * dtype.itemsize
            out[spec.name] = (dtype_name(dtype), tuple(spec.shape), from_sums(nbytes, totals[2 * i], totals[2 * i + 1]))
        return out

    def rank_handlers(self, ranks: Ranks) -> dict:
        """What this core's other ranks run for the requests rank 0 queues (see PublishPoints)."""
        self.ranks = ranks
        return {ROUTED: self.send_routed, AUDIT: self.audit_shares, MEMORY: self.describe_memory,
                OFFLOAD: lambda _: self._offload_here(),
                ONLOAD: lambda payload: self._onload_here(payload == DESCRIBE)}

    def send_routed(self, payload: bytes) -> Report | None:
        """Every rank of a sharded trainer: its part of a routed transfer (rank 0 is handed the same
        request its other ranks get as `payload`). The ranks then agree: one that failed fails the
        publish on rank 0, which answers the coordinator."""
        request = tpb.RoutedSend.FromString(payload)
        ranks = self.ranks or Ranks()
        report, error = None, None
        try:  # every rank checks it can send before any joins the transfer (a rank that cannot would hold
            self._require_on_device("publishing weights")  # the others and the replicas in its group)
            manifest = request.offer.manifest  # in the format rank 0 offered (its own format: the same)
            self.use_format(manifest.format if manifest.HasField("format") else None)
            sender = self._sender_now()
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        stamp("checked")
        if ranks.agree(error is None):
            if ranks.rank != 0:
                return None
            why = error or Unavailable("another rank of the trainer cannot send its shards (see its log)")
            if error is None:  # the receivers wait for the roster: tell them now, not at their deadline
                sender.refuse(request.offer, str(why))
            raise why
        try:  # every rank, in step: what it sends made from the weights as they are now (a quantized model's scales)
            self._source.refresh(ranks)
            stamp("agreed")
            report = sender.send(request.offer, list(request.answers), request.timeout_seconds)
            stamp("sent")
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        sent = [0] * ranks.world
        sent[ranks.rank] = report.wire_bytes if report is not None else 0
        failed, *sent = ranks.add_up([int(error is not None), *sent])
        stamp("added")
        if ranks.rank != 0:
            if error is not None:  # rank 0 answers for every rank; this one follows on to the next request
                log.warning("rank %d could not send its shards: %s", ranks.rank, error)
            return report
        if error is not None:
            raise error
        if failed:
            raise Unavailable(f"{failed} rank(s) of the trainer failed to send their shards (see their logs); "
                              "the replicas keep the version they had")
        report.nbytes = sum(s.nbytes for s in from_proto(request.offer.manifest))
        report.wire_bytes, report.rank_bytes = sum(sent), sent
        return report

    async def settle(self) -> None:
        """Returns once what was queued before it ran (a send whose replicas keep what they pulled mapped). A copy a
        replica queued as it prepared (an armed routed pull) is waited for by the ring that prepared it
        (Answer.copied), and the replicas let go of the mappings, after their copies, before an offload."""
        await self.run(lambda: None)

    async def offload(self) -> None:
        await self.run(self._offload_here, OFFLOAD, 0)

    def _offload_here(self) -> None:
        """Every rank's part of an offload, in step: its sender goes first (with the CUDA IPC exports that keep
        its storages alive), then the user's hook moves the weights, then memory receivers mapped is collected.
        Rank 0 answers once every rank has (a replica woken next must find the GPU free)."""
        def offload() -> None:
            self.drop_sender()
            if self.hooks[OFFLOAD] is not None:
                self.hooks[OFFLOAD]()
            if torch.cuda.is_initialized():
                torch.cuda.ipc_collect()  # memory receivers mapped (CUDA IPC) is freed only once collected
            self.offloaded = True
        self._in_step(offload, "offload")

    async def onload(self, describe: bool = False) -> tuple[tpb.MappedTensors, tpb.Facts, tpb.Routing | None] | None:
        """describe: also return where the weights now lie on the GPU, and its facts, for replicas on
        it to keep mapped until the offload (None when they cannot be mapped), and a sharded model's every
        rank's memory by digest (ShardedSender.routing: what its next offer names, for replicas to read
        ahead). The sender is then built now, not at the first offer."""
        return await self.run(lambda: self._onload_here(describe), ONLOAD, 0, DESCRIBE if describe else b"")

    def _onload_here(self, describe: bool = False) -> tuple[tpb.MappedTensors, tpb.Facts, tpb.Routing | None] | None:
        """Every rank's part of an onload, in step (see _offload_here). describe: rank 0 makes its sender now and
        returns where the weights lie (onload's); a sharded model's ranks each export their own storages, and
        rank 0 gathers those on its GPU, in rank order (ShardedSender.regions). Describing only saves the
        replicas time: a rank that cannot says why in its log, and the onload stands."""
        ranks = self.ranks or Ranks()
        found: list[tuple[tpb.MappedTensors | None, tpb.Facts]] = []

        def onload() -> None:
            if self.hooks[ONLOAD] is not None:
                self.hooks[ONLOAD]()
            self.offloaded = False
            if describe and (self.sharded or ranks.rank == 0):
                try:
                    sender = self._sender_now()
                    found.append((sender.regions(), local_facts(sender.device)))
                except Exception as e:  # noqa: BLE001 - the weights are back: the replicas map them at the update
                    log.warning("rank %d cannot say where its weights lie for the replicas to hold: %s", ranks.rank, e)
        if self._in_step(onload, "onload") or not describe:
            return None
        regions, facts = found[0] if found else (None, tpb.Facts())
        routing = None
        if self.sharded:  # (the same on every rank: each takes part in the gathers)
            mine = tpb.RankMemory(facts=facts, ipc=regions.ipc if regions is not None else ())
            every = [tpb.RankMemory.FromString(m) for m in ranks.gather(mine.SerializeToString())]
            ipc = [h for m in every if same_gpu(m.facts, facts) for h in m.ipc]
            regions = tpb.MappedTensors(ipc=ipc) if ipc and ranks.rank == 0 else None
            # every rank's mapped memory goes into the store now: the next offer's description moves only digests
            digests = self._keep_memory(ranks, self._sender, self._gather_memory(ranks, self._sender, None))
            routing = self._sender.routing(digests) if digests else None
        return None if regions is None else (regions, facts, routing)

    def _in_step(self, work: Callable[[], None], what: str) -> int:
        """Every rank: `work`, then the ranks agree; rank 0 raises if any failed (the others log it, and
        return how many did: they follow on)."""
        error = None
        try:
            work()
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            error = e
        ranks = self.ranks or Ranks()
        failed = ranks.agree(error is None)
        if ranks.rank != 0:
            if error is not None:
                log.warning("rank %d could not %s: %s", ranks.rank, what, error)
            return failed
        if error is not None:
            raise error
        if failed:
            raise Unavailable(f"{failed} rank(s) of the trainer could not {what} (see their logs)")
        return 0

    def close(self) -> None:
        self.drop_sender()


def _answered(answers: list[tpb.Answer]) -> list[bytes]:
    return sorted(a.SerializeToString(deterministic=True) for a in answers)


def _retrieved(task: asyncio.Task) -> None:
    """Retrieves a background task's failure for asyncio, which would warn of one nobody asked for (a send
    started at the offer of an abandoned sync: its receivers were aborted); whoever asks gets it."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a send started at the offer, or the end of broadcasts sent ahead, failed: %s", task.exception())


def _why_no_buffer(sender: WeightSender, delta: bool) -> str:
    """Why `sender`'s weights get no publish buffer ("": they may)."""
    if delta:
        return "delta updates send from the trainer's own copy"
    if not (PublishBuffer.fits(sender.source) and sender.allow_one_copy and tpb.BACKEND_CUDA_IPC in sender.backends):
        return "the weights are not resident, contiguous CUDA tensors offered over cuda_ipc"
    return ""
