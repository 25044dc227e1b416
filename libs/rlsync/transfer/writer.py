"""Where received bytes go: straight into the caller's tensors, or assembled and handed over.

A destination of the same dtype and layout receives bytes in place; one of another dtype gets the
assembled tensor cast into it when complete; a callable gets each tensor once complete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from functools import cached_property
from itertools import accumulate
from math import prod
from operator import attrgetter

import numpy as np
import torch

from rlsync.common.progress import PROGRESS
from rlsync.errors import DataLoss, InvalidArgument
from rlsync.flat import FlatStore
from rlsync.transfer import batched
from rlsync.transfer.checksum import checksum_bytes
from rlsync.transfer.dtypes import itemsize
from rlsync.transfer.manifest import Spec
from rlsync.transfer.spans import byte_view, cast_all, coalesce, copy_all, span

Destination = Mapping[str, torch.Tensor] | FlatStore | Callable[[str, torch.Tensor], None]

# The one-launch table of a pull whose every copy landed in place, by (its kind, the destinations'
# addresses, where the tensors lay in the sender's regions and how large those were), with the regions'
# addresses then: a pull of the same layout from regions mapped anew (a trainer's storages after its
# next onload, a replica that holds nothing) launches it with its sources moved (batched.rebased),
# looking at no tensor. The latest few are kept.
_REBASED: OrderedDict[tuple, tuple[batched.Table, np.ndarray]] = OrderedDict()
_REBASED_MAX = 4
_REBASED_LOCK = threading.Lock()


class DestWriter:
    """Laid out per update, so it does no per-tensor tensor work it can avoid: byte views of the
    destinations (`targets`) are made on first use, and a flat destination is recognised by its
    addresses alone (a one-copy update then never needs them). A FlatStore laid out as the manifest
    (an engine's own weights) is taken whole without looking at any tensor."""

    def __init__(self, specs: list[Spec], dest: Destination, device: torch.device):
        self.specs = specs
        self.device = device
        self.received = [0] * len(specs)
        self.landed = False  # every tensor's bytes are in (written in place in one go)
        self.table: batched.Table | None = None  # the one launch every tensor landed in place by, if one did
        self.memo: dict = {}  # what a receiver derives from these views (routed.Plans), kept with the writer
        flat = dest if isinstance(dest, FlatStore) else None
        self.dest = flat.views_for(specs) if flat is not None else dest  # (under the manifest's names)
        # All destinations back to back in one buffer (flat engine weights): one view of them all.
        self.whole = flat.whole_for(specs) if flat is not None else None
        if self.whole is not None:
            self.direct, self.in_place = [True] * len(specs), True
            return
        self.tensors  # noqa: B018 - every destination is checked now, before any byte moves
        self.direct = [t is not None and t.dtype == spec.dtype and t.is_contiguous()
                       for t, spec in zip(self.tensors, specs)]  # its bytes land in place
        self.in_place = all(self.direct)  # every tensor's bytes land in place: none is copied once complete
        if not self.in_place:
            self.targets  # noqa: B018 - buffers to cast from are allocated now, before any byte moves
        self.whole = self._whole() if self.in_place else None
        self._empty()

    def again(self) -> DestWriter:
        """This writer, laid out as it is, ready for another transfer into the same destinations (a
        repeat update's: rlsync.transfer.kept): nothing received yet."""
        self.received, self.landed, self.table = [0] * len(self.specs), False, None
        self._empty()
        return self

    def _empty(self) -> None:
        """Empty tensors are complete before any byte moves."""
        if self.whole is None:
            for i in self._sizes[1]:
                self._complete(i)

    @cached_property
    def _sizes(self) -> tuple[list[int], list[int], bool]:
        """(each tensor's bytes, the empty tensors, whether any has a checksum): what every update checks again."""
        sizes = list(map(_nbytes, self.specs))
        return sizes, [i for i, n in enumerate(sizes) if n == 0], any(map(_checksum, self.specs))

    @cached_property
    def tensors(self) -> list[torch.Tensor | None]:
        """Each destination (None: handed to a callable)."""
        if callable(self.dest):
            return [None] * len(self.specs)
        dest, out = self.dest, []
        for spec in self.specs:
            t = dest.get(spec.name)
            if t is None or t.numel() != prod(spec.shape):
                raise InvalidArgument(f"no destination tensor for {spec.name!r}" if t is None else
                                      f"destination {spec.name!r} has {t.numel()} elements, manifest "
                                      f"{list(spec.shape)}")
            out.append(t)
        return out

    @cached_property
    def pointers(self) -> list[int]:
        """Where each destination's bytes start."""
        return [t.data_ptr() for t in self.tensors]

    def _whole(self) -> torch.Tensor | None:
        """One uint8 view over every destination, when they lie end to end inside one storage."""
        parts = [(ptr, s.nbytes) for ptr, s in zip(self.pointers, self.specs) if s.nbytes]
        if not parts:
            return None
        start, end = parts[0][0], parts[0][0]
        for ptr, nbytes in parts:
            if ptr != end:
                return None
            end += nbytes
        storage = next(t for t, s in zip(self.tensors, self.specs) if s.nbytes).untyped_storage()
        base = storage.data_ptr()
        if not (base <= start and end <= base + storage.nbytes()):
            return None  # adjacent, but in two allocations
        return byte_view(storage, start - base, end - start, storage.device)

    @cached_property
    def targets(self) -> list[torch.Tensor]:
        """Flat uint8 per tensor: where its bytes land (the destination itself, or a buffer whose
        contents are cast into it when complete)."""
        return [t.reshape(-1).view(torch.uint8) if direct else
                torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device if t is None else t.device)
                for t, direct, spec in zip(self.tensors, self.direct, self.specs)]

    @cached_property
    def bases(self) -> list[int]:
        """The storage pointer under each target (coalescing compares them)."""
        return [t.untyped_storage().data_ptr() if t.numel() else 0 for t in self.targets]

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        n = data.numel()
        self.targets[index][offset:offset + n].copy_(data, non_blocking=True)
        self.mark(index, n)

    def write_many(self, pieces: list[tuple[int, int, torch.Tensor]]) -> None:
        """write() of every (tensor index, offset, bytes), in as few launches as copy_all makes."""
        copy_all((data, self.targets[index][offset:offset + data.numel()]) for index, offset, data in pieces)
        for index, _, data in pieces:
            self.mark(index, data.numel())

    def direct_view(self, index: int, offset: int, nbytes: int) -> torch.Tensor | None:
        """Where bytes [offset, offset+nbytes) of tensor `index` land, if they land in place."""
        return self.targets[index][offset:offset + nbytes] if self.direct[index] else None

    def direct_span(self, slices, base: int = 0) -> torch.Tensor | None:
        """One view where a planned bucket's slices (of tensors `base + slice.tensor`, each continuing
        the last: plan_buckets) land, if they land in place end to end: cut from `whole` where there
        is one (no view of any tensor is made)."""
        if self.whole is not None and slices:
            first, last = slices[0], slices[-1]
            return self.whole[self.starts[base + first.tensor] + first.src:
                              self.starts[base + last.tensor] + last.src + last.length]
        parts = [self.direct_view(base + s.tensor, s.src, s.length) for s in slices]
        return span(parts) if all(p is not None for p in parts) else None

    @cached_property
    def starts(self) -> list[int]:
        """Where each tensor's bytes start in `whole` (the manifest's tensors back to back)."""
        return list(accumulate((s.nbytes for s in self.specs), initial=0))

    def mark_many(self, marks: list[tuple[int, int]]) -> None:
        """mark() of every (tensor index, bytes), in one loop (a bucket of a mixture of experts lands hundreds
        of pieces: a call each was most of a repeat's Python per piece)."""
        PROGRESS.advance(len(marks))  # bytes landing are progress, whatever the event loop does meanwhile
        received = self.received
        if self.in_place:  # (a tensor complete has nothing more to do)
            for index, nbytes in marks:
                received[index] += nbytes
            return
        sizes = self._sizes[0]
        for index, nbytes in marks:
            received[index] += nbytes
            if received[index] == sizes[index]:
                self._complete(index)

    def mark(self, index: int, nbytes: int) -> None:
        """Records bytes that arrived (written through write(), or straight into direct_view())."""
        self.mark_many([(index, nbytes)])

    def write_whole(self, data: torch.Tensor) -> None:
        """All tensors at once, when both sides lay them out back to back (see `whole`)."""
        self.whole.copy_(data, non_blocking=True)
        PROGRESS.advance()
        self.landed = True  # every one lands in place: nothing to complete

    def write_all(self, sources: list[tuple[torch.Tensor, int] | None], plans: dict | None = None) -> None:
        """Writes whole tensors, given as (bytes, storage pointer of those bytes) or None to skip;
        runs that are contiguous on both sides become one copy, and copies start as they are found.
        `plans`: a dict kept as long as `sources` stay where they are (a held mapping's); where every
        copy lands in place and fits one kernel launch, the launch's table is kept there under the
        destinations' addresses, and a repeat write cuts no view and looks at no tensor pair again."""
        key = self._plan_key(plans, "copy")
        if key is not None:
            self._planned(plans, key, sources, lambda: copy_all(coalesce(
                item[:1] + (item[1], self.targets[i], self.bases[i])
                for i, item in enumerate(sources) if item is not None and item[0].numel())))
            return
        marks = []

        def direct():
            for i, item in enumerate(sources):
                if item is None or not item[0].numel():
                    continue
                if self.direct[i]:
                    marks.append(i)
                    yield item[0], item[1], self.targets[i], self.bases[i]
                else:
                    self.write(i, 0, item[0])

        copy_all(coalesce(direct()))
        for i in marks:
            self.mark(i, self.specs[i].nbytes)

    def write_cast(self, sources: list[torch.Tensor | None], plans: dict | None = None) -> None:
        """Writes whole tensors given flat in another dtype (None: an empty one), cast as they are
        copied: one pass over the bytes (spans.cast_all). `plans`: as for write_all."""
        def cast() -> batched.Table | None:
            pairs = []
            for i, src in enumerate(sources):
                spec = self.specs[i]
                if src is not None and src.numel() * itemsize(spec.dtype) != spec.nbytes:
                    raise DataLoss(f"{spec.name!r}: {src.numel()} elements sent, the manifest says "
                                   f"{list(spec.shape)}")
                if src is not None:
                    pairs.append((src, self.targets[i].view(spec.dtype)))
            return cast_all(pairs)

        key = self._plan_key(plans, "cast")
        if key is not None:
            self._planned(plans, key, sources, cast)
            return
        cast()
        for i, src in enumerate(sources):
            if src is not None:
                self.mark(i, self.specs[i].nbytes)

    def _plan_key(self, plans: dict | None, kind: str) -> tuple | None:
        """Where a kept launch may serve (every destination in place): the destinations' addresses."""
        if plans is None or not self.in_place:
            return None
        whole = self.whole  # laid out as the manifest (whose sizes `plans` is kept for): its address says all
        return (kind, whole.data_ptr()) if whole is not None else (kind, *self.pointers)

    def _planned(self, plans: dict, key: tuple, sources: list, write: Callable[[], batched.Table | None]) -> None:
        """Launches the table kept under `key` for these very `sources` (a held layout keeps its list),
        else writes, and keeps the table when everything went in one launch."""
        kept = plans.get(key)
        if kept is not None and kept[0] is sources:
            batched.launch(kept[1])
            self.table = kept[1]
        else:
            self.table = table = write()
            if table is not None:  # every copy in one launch: the next write only launches it
                if len(plans) >= 8:  # destinations come and go: keep the latest few
                    plans.clear()
                plans[key] = sources, table  # the list itself: its id alone could be a new list's
        self.landed = True  # every one lands in place: nothing to complete

    def write_rebased(self, kind: str, where: tuple, bases: list[int]) -> bool:
        """Launches the table a pull of the same `kind` ("copy" or "cast") into these destinations from the
        same layout `where` kept (keep_rebased), its sources moved to the regions at `bases` -> whether
        one was kept; if not, nothing was written."""
        table = self.rebased_table(kind, where, bases)
        if table is None:
            return False
        batched.launch(table)
        self.landed = True
        return True

    def rebased_table(self, kind: str, where: tuple, bases: list[int]) -> batched.Table | None:
        """The table write_rebased would launch (its rows uploaded on the current stream), or None."""
        key = self._plan_key({}, kind)
        with _REBASED_LOCK:
            kept = _REBASED.get((key, where)) if key is not None else None
        return None if kept is None else batched.rebased(kept[0], kept[1], np.array(bases, dtype=np.int64))

    def keep_rebased(self, kind: str, where: tuple, bases: list[int]) -> None:
        """Keeps the table this write landed by, if it did in one launch, for write_rebased."""
        key = self._plan_key({}, kind)
        if key is None or self.table is None:
            return
        with _REBASED_LOCK:
            _REBASED[(key, where)] = self.table, np.array(bases, dtype=np.int64)
            _REBASED.move_to_end((key, where))
            while len(_REBASED) > _REBASED_MAX:
                _REBASED.popitem(last=False)

    def _typed(self, index: int) -> torch.Tensor:
        spec = self.specs[index]
        return self.targets[index].view(spec.dtype).view(spec.shape)

    def _complete(self, index: int) -> None:
        if self.direct[index]:
            return
        spec = self.specs[index]
        if callable(self.dest):
            self.dest(spec.name, self._typed(index))
        else:
            self.dest[spec.name].copy_(self._typed(index).view(self.dest[spec.name].shape))

    def finish(self) -> int:
        """Checks that every byte arrived (and per-tensor checksums, when the manifest has them);
        returns the bytes received."""
        sizes, _, checked = self._sizes
        if not self.landed and self.received != sizes:
            short = [(s.name, got, s.nbytes) for s, got in zip(self.specs, self.received) if got != s.nbytes]
            name, got, want = short[0]
            raise DataLoss(f"transfer truncated: {len(short)} tensor(s) incomplete, e.g. {name!r} got "
                           f"{got} of {want} bytes; the destination must not be used")
        for i, spec in enumerate(self.specs if checked else ()):
            if spec.checksum:
                got = checksum_bytes(self.targets[i])
                if got != spec.checksum:
                    raise DataLoss(f"checksum mismatch for {spec.name!r} (sent {spec.checksum}, received {got}): "
                                   "the bytes were corrupted on the way; the destination must not be used")
        return sum(sizes) if self.landed else sum(self.received)


_nbytes, _checksum = attrgetter("nbytes"), attrgetter("checksum")
