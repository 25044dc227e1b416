"""The trainer's publish buffer: its weights copied, at each offer, into memory of its own that
replicas on its GPU (or reading it by P2P: rlsync.publish.holders) keep mapped and pull from while training
goes on.

Without it, a replica reads the trainer's parameters themselves, so nothing may train until every
replica has its copy (the colocated sequence keeps the trainer still; the serving modes publish
under the trainer's lock). With it, the trainer is held for one device-to-device copy of the
weights (one copy when they are flat, one kernel launch over a kept table when they are
scattered), and the replicas' copies then run beside the next training step. The price is one more
copy of the weights on the trainer's GPU, so a trainer asks for it (`publish_buffer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlsync.flat import FlatStore
from rlsync.transfer import WeightSender
from rlsync.transfer.source import ResidentSource
from rlsync.transfer.spans import span
from rlsync.transfer.writer import DestWriter


class PublishBuffer:
    """A flat copy of a resident source's tensors, laid out as its manifest, and the sender that
    offers it. Its memory never moves: a replica that holds it mapped maps nothing again."""

    def __init__(self, source: ResidentSource, make_sender: Callable[[ResidentSource], WeightSender]):
        self.specs, self.device = source.specs(), source.device
        self.store = FlatStore({s.name: (s.shape, s.dtype) for s in self.specs}, self.device)
        self.sender = make_sender(ResidentSource(self.store.views, adapter=source.adapter, frozen=source.frozen))
        views = source.resident()
        self._whole = span([v for v in views if v.numel()])  # the source's bytes, when flat (rlsync's trainer)
        self._sources = [(v, v.untyped_storage().data_ptr()) if v.numel() else None for v in views]
        self._plans: dict = {}  # the kept launch table of a scattered source (DestWriter.write_all)

    @staticmethod
    def fits(source) -> bool:
        """Whether a source can be copied into a buffer: resident, contiguous CUDA tensors."""
        return isinstance(source, ResidentSource) and source.device.type == "cuda" and source.contiguous

    def refresh(self) -> None:
        """Copies the source's current values into the buffer; returns once they are there."""
        writer = DestWriter(self.specs, self.store, self.device)
        if self._whole is not None and writer.whole is not None:  # flat on both sides: one copy
            writer.write_whole(self._whole)
        else:  # one copy per tensor, in one launch
            writer.write_all(self._sources, self._plans)
        if self.device.type == "cuda":  # the buffer is whole before anything reads it, on any stream
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.sender.close()
