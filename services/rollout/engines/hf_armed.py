"""The hf engine's armed pulls (rlsync.transfer.armed): which storages it holds for whom, the last
pull it made from them, and its bell. A colocated replica's update is then a copy the trainer
starts on the GPU: no thread of this process runs between the offer and the bytes in place."""

from __future__ import annotations

import torch

from rlsync.transfer.armed import Armed, Bell, key_of
from rlsync.transfer.backends.slots import contiguous
from rlsync.transfer.held import HELD
from rlsync.transfer.v1 import transfer_pb2 as pb


class Arming:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled = device, enabled
        self.bell: Bell | None = None
        self.held: tuple[str, tuple[bytes, ...]] | None = None  # the last hold: holder, storages in its order
        self.plan: tuple | None = None  # (specs, mapped locations, the one run they copy) of the last held pull

    def hold(self, holder: str, handles: list[bytes]) -> bytes:
        """Records a hold -> the bell's handle, for the holder to ring."""
        self.held = (holder, tuple(dict.fromkeys(handles)))
        if self.bell is None:
            self.bell = Bell(self.device)
        return self.bell.handle

    def release(self, holder: str) -> None:
        if self.held is not None and self.held[0] == holder:
            self.held = None

    def learn(self, specs: list, mapped: pb.MappedTensors) -> None:
        """Remembers a pull from held storages that its sender waited for on the GPU (a ring), to
        queue it again at the next wake. One run of one storage into the whole store, or nothing; and
        nothing for a manifest with checksums (they change with every version, and must be checked), nor
        for a pull that casts (MappedTensors.dtype: not a copy of bytes)."""
        run = None if not self.enabled or mapped.dtype or any(s.checksum for s in specs) else \
            contiguous(specs, list(zip(mapped.region, mapped.offset)))
        self.plan = (specs, tuple(mapped.region), tuple(mapped.offset), run) if run is not None else None

    def arm(self, weights) -> None:
        """At a wake of the weights that an update will land in (the backup holds the served ones):
        queues the last held pull again, if the same storages are held and it fits the store."""
        if self.plan is None or self.held is None or self.bell is None or weights.armed is not None:
            return
        if not weights.pending_restore or weights.store is None:
            return
        specs, region, offset, (index, start, nbytes) = self.plan
        handles = self.held[1]
        src = HELD.get(handles[index]) if index < len(handles) else None
        dst = weights.store.whole_for(specs)
        if src is None or dst is None or dst.numel() != nbytes or src.numel() < start + nbytes:
            return
        source = src[start:start + nbytes]
        weights.armed = Armed(self.bell, lambda: dst.copy_(source, non_blocking=True), nbytes,
                              key_of(specs, handles, region, offset))

    def adopt(self, weights, specs: list, mapped: pb.MappedTensors) -> Armed | None:
        """The armed copy, when it is this offer's (rung with a bell value); else None."""
        armed = weights.armed
        return armed if armed is not None and armed.adopt(specs, mapped) else None  # (a cast: its dtypes differ)
