"""Routed transfers: every trainer rank sends its pieces straight to the engine ranks that load them,
point to point, in one process group over the trainer's ranks and the engine's (gloo on CPU, NCCL
on GPUs). No rank gathers a tensor; an engine rank receives exactly the boxes it loads.

Every member computes the same schedule from the routes (`rlsync.transfer.routes`) and the bucket
size: each transfer's pieces are packed into buckets (`plan.py`), and the buckets of all transfers
are taken in turn (bucket 0 of every transfer, then bucket 1, ...), each with its own tag. A member
runs only its own sends and receives, in that order, two at a time: since all follow one order, the
earliest pending operation always has both ends on their way to it, so no member waits on another
that waits on it. A sender packs a bucket into a slot unless its bytes already lie end to end in
one tensor; a receiver lands a bucket straight in place when its destination is contiguous there.

Group ranks: trainer rank k is k, engine rank e is `senders + e`.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache, partial
from math import prod

import torch

from rlsync.errors import DeadlineExceeded, InvalidArgument, Unavailable
from rlsync.transfer import batched
from rlsync.transfer.backends.base import sync
from rlsync.transfer.control import Deadline
from rlsync.transfer.manifest import Spec
from rlsync.transfer.plan import Bucket, cached_plan
from rlsync.transfer.routes import Box, Piece, Routes, extent, relative
from rlsync.transfer.spans import FEW, EachCopy, coalesce, copy_all, stacked
from rlsync.transfer.writer import DestWriter

WINDOW = 2  # operations in flight per member


@dataclass(frozen=True)
class Op:
    transfer: int  # index into routes.transfers
    bucket: Bucket
    tag: int


@lru_cache(maxsize=16)
def schedule(routes: Routes, bucket_bytes: int) -> tuple[Op, ...]:
    """Every bucket of every transfer (that has a receiver), in the one order all members follow (kept: a
    repeat update schedules the same routes)."""
    plans = [cached_plan(tuple(p.nbytes(routes.tensors) for p in t.pieces), bucket_bytes) if t.dsts else []
             for t in routes.transfers]
    ops, tag = [], 0
    for i in range(max((len(p) for p in plans), default=0)):
        for j, plan in enumerate(plans):
            if i < len(plan):
                ops.append(Op(j, plan[i], tag))
                tag += 1
    return tuple(ops)


def piece_name(name: str, box: Box) -> str:
    return name + "[" + ",".join(f"{a}:{b}" for a, b in box) + "]"


class _Window:
    """At most WINDOW operations in flight; a finished one runs its completion (scatter, release).

    A GPU operation is waited for by polling its completion, never with `Work.wait(timeout)`: NCCL's
    timed wait sleeps in steps of a millisecond or more, which at one wait per bucket was most of a
    transfer (bench/sharded.py, two GPUs). Once done, its untimed wait orders the caller's stream
    after it (the slot it used is then free for the stream's next copy)."""

    def __init__(self, deadline: Deadline, device: torch.device):
        self.deadline, self.device = deadline, device
        self.pending: deque = deque()
        self.waited = self.landed = 0.0  # seconds waiting for operations, and in their completions

    def profile(self, into: dict[str, float] | None) -> None:
        if into is not None:
            into.update(wait=self.waited, land=self.landed)

    def reserve(self) -> None:
        """Room for one more operation: called before its slot is written (the one WINDOW back is done)."""
        while len(self.pending) >= WINDOW:
            self._finish_one()

    def add(self, works: list, done: Callable[[], None] | None = None) -> None:
        self.pending.append((works, done))

    def drain(self) -> None:
        while self.pending:
            self._finish_one()

    def __enter__(self) -> _Window:
        return self

    def __exit__(self, *exc) -> None:
        self.pending.clear()  # a failure leaves no work holding the group (see sharded._close)

    def _finish_one(self) -> None:
        works, done = self.pending.popleft()
        start = time.perf_counter()
        for w in works:
            try:
                if self.device.type == "cuda":
                    _poll(w, self.deadline)
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=self.deadline.remaining("moving a bucket")))
            except (RuntimeError, DeadlineExceeded) as e:
                self.pending.clear()
                if isinstance(e, DeadlineExceeded) or "imeout" in str(e) or "imed out" in str(e):
                    raise DeadlineExceeded(f"{self.deadline.what}: a peer did not take part in time ({e})") from e
                raise Unavailable(f"{self.deadline.what}: a peer failed or is gone ({e})") from e
        waited = time.perf_counter()
        self.waited += waited - start
        if done is not None:
            done()
            self.landed += time.perf_counter() - waited


POLL_SECONDS = 20e-6  # between looks at a GPU operation still running (a look costs a few microseconds)


def _poll(work, deadline: Deadline) -> None:
    """Until `work` completes (or fails: its wait() then raises); DeadlineExceeded past the deadline."""
    while not work.is_completed():
        deadline.remaining("moving a bucket")
        time.sleep(POLL_SECONDS)


def send(pg, routes: Routes, rank: int, piece: Callable[[Piece], torch.Tensor], bucket_bytes: int,
         deadline: Deadline, device: torch.device, profile: dict[str, float] | None = None,
         source: Callable[[Piece], tuple[torch.Tensor, torch.dtype]] | None = None,
         plans: Plans | None = None) -> int:
    """Trainer rank `rank`'s share: its pieces (made by `piece`, contiguous, in the engine's dtype)
    to every engine rank that loads them. Returns the payload bytes it sent (a bucket once per receiver);
    `profile` gets the seconds spent waiting for operations to finish. `source`: a piece's values where they
    lie and the dtype they travel in; the whole pieces of a packed bucket are then copied into it in one
    launch, cast on the way (a mixture of experts' hundreds of small pieces: one launch, not one each).
    `plans`: how the last send of these routes from the same storages packed each bucket (Plans), kept and reused."""
    plans = plans if plans is not None else Plans()
    with _Window(deadline, device) as window:
        with plans.kept_if_done():
            sent = _send(pg, routes, rank, piece, bucket_bytes, window, device, source, plans)
        window.profile(profile)
        return sent


class _Slots:
    """WINDOW staging buffers of `bucket_bytes` each, allocated when first needed (a member that sends or
    lands every bucket in place never needs them)."""

    def __init__(self, bucket_bytes: int, device: torch.device):
        self.bucket_bytes, self.device, self.slots, self.turn = bucket_bytes, device, [], 0

    def next(self, nbytes: int) -> torch.Tensor:
        if len(self.slots) < WINDOW:
            self.slots.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
        slot = self.slots[self.turn % WINDOW]
        self.turn += 1
        return slot[:nbytes]


class Plans:
    """How a member moves its buckets, kept for a repeat of the same routes between the same memory (its owner
    keys it by where that memory lies, and lets it go with it): its slots, and a plan per bucket. A sender's
    (`_pack_plan`) packs the bucket's whole pieces in one launch; a receiver's (`_land_plan`) lands it in place,
    or out of its slot in one launch. A repeat does no Python per piece."""

    def __init__(self):
        self.slots: _Slots | None = None
        self.buckets: dict[int, tuple] = {}

    def slots_for(self, ops: Sequence[Op], mine: Callable[[Op], bool], device: torch.device) -> _Slots:
        """The slots, made as large as the largest of the buckets `mine` picks (a small model's: less than a bucket)."""
        if self.slots is None:
            self.slots = _Slots(max((op.bucket.nbytes for op in ops if mine(op)), default=0), device)
        return self.slots

    @contextmanager
    def kept_if_done(self):
        """Forgets every plan if the transfer is cut short: it may have taken a slot for a bucket it kept no plan of,
        which would put two buckets in a row in one slot. The next transfer plans anew."""
        try:
            yield
        except BaseException:
            self.slots, self.buckets = None, {}
            raise


def _pack_plan(op: Op, transfer, routes: Routes, slots: _Slots, source) -> tuple:
    """A bucket's slot view, the typed views of it that whole pieces go into, the views of where those lie,
    and the other slices (packed as bytes: a part of a piece, a piece with no source or not aligned in the slot)."""
    view, into, values, rest = slots.next(op.bucket.nbytes), [], [], []
    for s in op.bucket.slices:
        p = transfer.pieces[s.tensor]
        if source is not None and s.src == 0 and s.length == p.nbytes(routes.tensors):
            at, dtype = source(p)
            if (typed := _typed(view[s.dst:s.dst + s.length], dtype, at.shape)) is not None:
                into.append(typed)
                values.append(at)
                continue
        rest.append(s)
    if view.device.type == "cpu" and values:  # (no kernel takes them all at once there: alike ones go as one)
        values, into = (list(side) for side in zip(*stacked(list(zip(values, into)))))
    return view, into, values, rest


def _send(pg, routes, rank, piece, bucket_bytes, window, device, source, plans) -> int:
    ops = schedule(routes, bucket_bytes)
    slots = plans.slots_for(ops, lambda op: routes.transfers[op.transfer].src == rank, device)
    current: dict[int, tuple[int, torch.Tensor]] = {}  # transfer -> (piece index, its bytes): one piece each
    last = {op.transfer: op.tag for op in ops}  # each transfer's last bucket: its piece goes after it
    sent = 0
    for op in ops:
        transfer = routes.transfers[op.transfer]
        if transfer.src != rank:
            continue
        window.reserve()

        def bytes_of(index: int, key: int = op.transfer, pieces=transfer.pieces) -> torch.Tensor:
            """Piece `index` of this transfer; the one before it is let go first (one made at a time)."""
            held = current.pop(key, (-1, None))
            if held[0] == index:
                current[key] = held
                return held[1]
            del held
            data = _bytes(piece(pieces[index]))
            current[key] = (index, data)
            return data

        if len(op.bucket.slices) == 1 and (s := op.bucket.slices[0]) and \
                (view := bytes_of(s.tensor)[s.src:s.src + s.length]).device == device:
            pass  # one piece's bytes, contiguous: sent from where they are
        else:  # packed: whole pieces from where they lie in one launch, the others slice by slice, one at a time
            if op.tag not in plans.buckets:
                plans.buckets[op.tag] = _pack_plan(op, transfer, routes, slots, source)
            view, into, values, rest = plans.buckets[op.tag]
            for s in rest:
                view[s.dst:s.dst + s.length].copy_(bytes_of(s.tensor)[s.src:s.src + s.length], non_blocking=True)
            if into:
                torch._foreach_copy_(into, values, non_blocking=True)
            # no sync: a send waits for the caller's stream, and the slot's last send is done (reserve)
        works = [pg.send([view], routes.senders + dst, op.tag) for dst in transfer.dsts]
        window.add(works)
        if last[op.transfer] == op.tag:
            current.pop(op.transfer, None)  # a view in flight keeps what it sends; nothing else is held
        sent += op.bucket.nbytes * len(transfer.dsts)
    window.drain()
    return sent


def destinations(routes: Routes, rank: int, specs: Sequence[Spec], staging: Mapping[str, tuple[Box, torch.Tensor]]) \
        -> tuple[list[Spec], dict[str, torch.Tensor]]:
    """Engine rank `rank`'s pieces as specs, and where each lands: a view of the staging tensor of
    its tensor (`staging[name]`: the box it holds of the whole tensor, and that box's tensor). What
    does not depend on where the staging lies (names, cuts, specs) is derived once per layout."""
    layout = tuple((name, box, t.dtype, t.shape) for name, (box, t) in staging.items())
    piece_specs, cuts = _destination_plan(routes, rank, tuple(specs), layout)
    return list(piece_specs), {name: staging[of][1][cut] if cut else staging[of][1] for name, of, cut in cuts}


@lru_cache(maxsize=8)
def _destination_plan(routes: Routes, rank: int, specs: tuple[Spec, ...], layout: tuple) \
        -> tuple[list[Spec], list[tuple[str, str, tuple[slice, ...] | None]]]:
    """destinations(), less the views: each piece's spec, and (its name, the staging tensor it lands in, its cut
    of that tensor). `layout`: each staging tensor's (name, box, dtype, shape)."""
    staged = {name: (box, dtype) for name, box, dtype, _ in layout}
    piece_specs, cuts = [], []
    for transfer in routes.of_receiver(rank):
        for p in transfer.pieces:
            spec = specs[p.tensor]
            if spec.name not in staged:
                raise InvalidArgument(f"engine rank {rank} loads {spec.name!r}{[list(b) for b in p.box]} by its "
                                      "layout, but has no staging for it: the layout it answered with and the "
                                      "tensors it staged disagree")
            box, dtype = staged[spec.name]
            region = relative(p.box, box)
            name, shape = piece_name(spec.name, p.box), extent(p.box)
            cuts.append((name, spec.name, tuple(slice(a, b) for a, b in region) if region else None))
            piece_specs.append(Spec(name, spec.dtype, shape, prod(shape) * dtype.itemsize))
    return piece_specs, cuts


def receive(pg, routes: Routes, rank: int, writer: DestWriter, bucket_bytes: int, deadline: Deadline,
            device: torch.device, profile: dict[str, float] | None = None) -> int:
    """Engine rank `rank`'s share: every piece it loads, written through `writer` (laid out over
    `destinations(...)`, pieces in the order they list them). Returns the bytes received; `profile`
    (as send's) gets the seconds spent waiting for operations and landing what they brought."""
    first: dict[int, int] = {}  # transfer -> index of its first piece in the writer
    for j, transfer in enumerate(routes.transfers):
        if rank in transfer.dsts:
            first[j] = sum(len(routes.transfers[i].pieces) for i in first)
    with _Window(deadline, device) as window:
        received = _receive(pg, routes, first, writer, bucket_bytes, window, device)
        window.profile(profile)
        return received


def _land_plan(op: Op, base: int, writer: DestWriter, slots: _Slots, device: torch.device) -> tuple:
    """The view a bucket is received into (its destination when it lands in place, else a slot), the slices it
    then counts, and the copies out of the slot (their table once made, and whether it landed before)."""
    marks = [(base + s.tensor, s.length) for s in op.bucket.slices]
    view = writer.direct_span(op.bucket.slices, base)
    if view is not None and view.device == device:
        return view, marks, None
    view = slots.next(op.bucket.nbytes)
    copies = [(view[s.dst:s.dst + s.length], writer.targets[base + s.tensor][s.src:s.src + s.length])
              for s in op.bucket.slices]
    if view.device.type == "cpu":  # no kernel takes them all at once there: slices that continue each other on both
        # sides go as one, and so do alike ones (a bucket of 105 expert slices: 10 copies); laid out once
        runs = coalesce((src, src.untyped_storage().data_ptr(), dst, dst.untyped_storage().data_ptr())
                        for src, dst in copies)
        return view, marks, [copies, EachCopy(stacked(list(runs))), True]
    return view, marks, [copies, None, False]  # (the copies, what queues them again once made, landed before)


def _receive(pg, routes, first, writer, bucket_bytes, window, device) -> int:
    ops = schedule(routes, bucket_bytes)
    # Kept with the writer, as it is with its staging, for this very schedule: other receivers' pairs in or out of
    # the group (a replica that pulls now) shift every operation's place in it, which the plans are keyed by.
    kept = writer.memo.get(("plans", bucket_bytes))
    if kept is None or kept[0] is not ops:
        kept = writer.memo[("plans", bucket_bytes)] = ops, Plans()
    plans = kept[1]
    slots = plans.slots_for(ops, lambda op: op.transfer in first, device)
    with plans.kept_if_done():
        for j, op in enumerate(ops):
            if op.transfer not in first:
                continue
            window.reserve()
            if j not in plans.buckets:  # (made in the schedule's order: each takes the slot it took the first time)
                plans.buckets[j] = _land_plan(op, first[op.transfer], writer, slots, device)
            view, marks, copies = plans.buckets[j]

            def land(marks=marks, copies=copies):
                if copies is not None:  # no sync: the receive that reuses the slot two operations later waits
                    if copies[1] is not None:
                        copies[1]()
                    else:  # a repeat makes a table of even a few copies: it is launched again at every repeat
                        table = copy_all(copies[0], few=1 if copies[2] else FEW)
                        copies[1] = partial(batched.launch, table) if table is not None else None
                        copies[2] = True
                writer.mark_many(marks)

            window.add([pg.recv([view], routes.transfers[op.transfer].src, op.tag)], land)
        window.drain()
    sync(device)
    return writer.finish()


def _typed(region: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
    """A bucket's bytes `region` as a tensor of `dtype` and `shape`, or None where its offset does not align
    with the dtype (the piece is then packed as bytes)."""
    try:
        return region.view(dtype).view(shape)
    except RuntimeError:
        return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
