"""Where received bytes go: straight into the caller's tensors, or assembled and handed over.

A destination of the same dtype and layout receives bytes in place; one of another dtype gets the
assembled tensor cast into it when complete; a callable gets each tensor once complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from rlsync.errors import DataLoss, InvalidArgument
from rlsync.transfer.checksum import checksum_bytes
from rlsync.transfer.manifest import Spec
from rlsync.transfer.spans import coalesce, span

Destination = Mapping[str, torch.Tensor] | Callable[[str, torch.Tensor], None]


class DestWriter:
    def __init__(self, specs: list[Spec], dest: Destination, device: torch.device):
        self.specs = specs
        self.dest = dest
        self.device = device
        self.received = [0] * len(specs)
        self.targets: list[torch.Tensor] = []  # flat uint8 per tensor: where its bytes land
        self.direct: list[bool] = []
        for spec in specs:
            target, direct = self._target(spec)
            self.targets.append(target)
            self.direct.append(direct)
        self.bases = [t.untyped_storage().data_ptr() if t.numel() else 0 for t in self.targets]
        # All destinations back to back in one buffer (flat engine weights): one view of them all.
        self.whole = span([t for t, direct in zip(self.targets, self.direct) if t.numel()]) \
            if all(self.direct) else None
        for i, spec in enumerate(specs):
            if spec.nbytes == 0:
                self._complete(i)

    def _target(self, spec: Spec) -> tuple[torch.Tensor, bool]:
        if callable(self.dest):
            return torch.empty(spec.nbytes, dtype=torch.uint8, device=self.device), False
        if spec.name not in self.dest:
            raise InvalidArgument(f"no destination tensor for {spec.name!r}")
        t = self.dest[spec.name]
        if t.numel() != _numel(spec.shape):
            raise InvalidArgument(f"destination {spec.name!r} has {t.numel()} elements, manifest {list(spec.shape)}")
        if t.dtype == spec.dtype and t.is_contiguous():
            return t.reshape(-1).view(torch.uint8), True
        return torch.empty(spec.nbytes, dtype=torch.uint8, device=t.device), False

    def write(self, index: int, offset: int, data: torch.Tensor) -> None:
        n = data.numel()
        self.targets[index][offset:offset + n].copy_(data, non_blocking=True)
        self.mark(index, n)

    def direct_view(self, index: int, offset: int, nbytes: int) -> torch.Tensor | None:
        """Where bytes [offset, offset+nbytes) of tensor `index` land, if they land in place."""
        return self.targets[index][offset:offset + nbytes] if self.direct[index] else None

    def mark(self, index: int, nbytes: int) -> None:
        """Records bytes that arrived (written through write(), or straight into direct_view())."""
        self.received[index] += nbytes
        if self.received[index] == self.specs[index].nbytes:
            self._complete(index)

    def write_whole(self, data: torch.Tensor) -> None:
        """All tensors at once, when both sides lay them out back to back (see `whole`)."""
        self.whole.copy_(data, non_blocking=True)
        for i, spec in enumerate(self.specs):
            if spec.nbytes:
                self.mark(i, spec.nbytes)

    def write_all(self, sources: list[tuple[torch.Tensor, int] | None]) -> None:
        """Writes whole tensors, given as (bytes, storage pointer of those bytes) or None to skip;
        runs that are contiguous on both sides become one copy."""
        pairs, marks = [], []
        for i, item in enumerate(sources):
            if item is None or not item[0].numel():
                continue
            if self.direct[i]:
                pairs.append((item[0], item[1], self.targets[i], self.bases[i]))
                marks.append(i)
            else:
                self.write(i, 0, item[0])
        for src, dst in coalesce(pairs):
            dst.copy_(src, non_blocking=True)
        for i in marks:
            self.mark(i, self.specs[i].nbytes)

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
        short = [(s.name, got, s.nbytes) for s, got in zip(self.specs, self.received) if got != s.nbytes]
        if short:
            name, got, want = short[0]
            raise DataLoss(f"transfer truncated: {len(short)} tensor(s) incomplete, e.g. {name!r} got "
                           f"{got} of {want} bytes; the destination must not be used")
        for i, spec in enumerate(self.specs):
            if spec.checksum:
                got = checksum_bytes(self.targets[i])
                if got != spec.checksum:
                    raise DataLoss(f"checksum mismatch for {spec.name!r} (sent {spec.checksum}, received {got}): "
                                   "the bytes were corrupted on the way; the destination must not be used")
        return sum(self.received)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
