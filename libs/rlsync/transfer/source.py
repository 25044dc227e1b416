"""What a sender sends: named tensors described up front, their bytes produced when a transfer runs.

A source may be a LoRA adapter (rlsync.lora): `adapter` then describes it for the manifest, and
`frozen` holds the base it applies to, which receivers already have: never sent, but audited.

Two kinds, one interface for the channels (`job.sources[i]` is tensor i's bytes, flat uint8):
- ResidentSource: whole tensors already in memory (a flat parameter store, a state dict). Channels
  index them in any order, several backends at once; a receiver may map them (one copy).
- StreamedSource: each tensor is produced on demand, in manifest order, and dropped when the next
  one is asked for: cast or fused on the fly. A pass walks every tensor exactly once (a `produce`
  that is a collective would have every rank run the same sequence blind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from rlsync.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlsync.transfer.checksum import as_bytes, checksum_tensor
from rlsync.transfer.dtypes import dtype_name
from rlsync.transfer.manifest import Spec
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.v1 import transfer_pb2 as pb


class ResidentSource:
    """`arena`: the shared memory the CPU tensors were allocated from, if any (receivers map it).

    The tensors' values are read at send time; their layout (shapes, dtypes, where they lie) is
    read once: a tensor that changes shape needs a new source (a trainer makes one after an onload)."""

    format = None  # the WeightFormat its tensors were quantized to (a quantizing stage's: StreamedSource)
    quantized: frozenset[str] = frozenset()  # the names of those tensors (audited as they are, never cast)

    def __init__(self, tensors: Mapping[str, torch.Tensor], arena: SharedArena | None = None,
                 adapter: pb.LoraAdapter | None = None, frozen: Mapping[str, torch.Tensor] | None = None):
        self.tensors = dict(tensors)
        self.arena = arena
        self.adapter, self.frozen = adapter, dict(frozen or {})
        kinds = {t.device.type for t in self.tensors.values()}
        if len(kinds) > 1:
            raise InvalidArgument(f"tensors live on several device types ({', '.join(sorted(kinds))}): "
                                  "send each device's tensors with its own sender")
        self.device = next(iter(self.tensors.values())).device if self.tensors else torch.device("cpu")
        self.contiguous = all(t.is_contiguous() for t in self.tensors.values())
        self._views: list[torch.Tensor] | None = None
        self._specs: list[Spec] | None = None

    def specs(self, checksums: bool = False) -> list[Spec]:
        """Made once (their checksums, which read the values, at every call that asks for them)."""
        if checksums:
            return [Spec.of(n, t, True) for n, t in self.tensors.items()]
        if self._specs is None:
            self._specs = [Spec.of(n, t) for n, t in self.tensors.items()]
        return self._specs

    def resident(self) -> list[torch.Tensor]:
        """Every tensor's bytes, now: channels may read them in any order and map them. Byte views
        of contiguous tensors are made once, when first needed (values are read at send time)."""
        if not self.contiguous:
            return [as_bytes(t) for t in self.tensors.values()]
        if self._views is None:
            self._views = [as_bytes(t) for t in self.tensors.values()]
        return self._views

    def items(self):
        """(name, tensor) for audits."""
        return self.tensors.items()


class StreamedSource:
    """Tensors made one at a time by `produce(i)` (for `specs[i]`), in order.

    `produce` may be a collective (every rank of a sharded model calls it for the same i): a pass
    therefore always runs from the first tensor to the last, whatever the channel asked for.
    """

    arena = None  # produced tensors never live in shared memory a receiver could map
    format = None  # see ResidentSource (rlsync.publish.quantized sets both)
    quantized: frozenset[str] = frozenset()

    def __init__(self, specs: list[Spec], device: torch.device, produce: Callable[[int], torch.Tensor],
                 adapter: pb.LoraAdapter | None = None, frozen: Mapping[str, torch.Tensor] | None = None,
                 originals: list[torch.Tensor] | None = None):
        """originals: when every tensor is one whole tensor cast (`produce(i)` is `originals[i]` cast to
        specs[i]'s dtype), those tensors: a receiver on their GPU may map them and cast as it copies
        (MappedTensors.dtype), the one pass over the bytes."""
        if originals is not None and not (len(originals) == len(specs) and all(
                t.is_contiguous() and t.shape == s.shape for t, s in zip(originals, specs))):
            raise InvalidArgument("originals must be one contiguous tensor of each spec's shape")
        self.originals = originals
        self._specs = specs
        self.adapter, self.frozen = adapter, dict(frozen or {})
        self.device = device
        self.produce = produce
        self.passes = 0  # passes started, so a caller can finish the ones its peers expect

    def specs(self, checksums: bool = False) -> list[Spec]:
        if not checksums:
            return list(self._specs)
        with self.stream() as pass_:
            sums = {s.name: checksum_tensor(t) for s, t in zip(self._specs, pass_.tensors())}
        return [Spec(s.name, s.dtype, s.shape, s.nbytes, sums[s.name]) for s in self._specs]

    def resident(self) -> None:
        return None

    def stream(self) -> Pass:
        self.passes += 1
        return Pass(self._specs, self.produce)

    def items(self):
        """(name, tensor) for audits: one pass, finished even if the reader stops early."""
        with self.stream() as pass_:
            yield from zip((s.name for s in self._specs), pass_.tensors())


class Pass(Sequence):
    """One walk over a StreamedSource: `pass_[i]` is tensor i's bytes; indices only move forward.
    Holds the current tensor (a channel may keep a few more alive while their buckets are in flight)."""

    def __init__(self, specs: list[Spec], produce: Callable[[int], torch.Tensor]):
        self.specs, self.produce = specs, produce
        self.next = 0
        self.index, self.tensor, self.view = -1, None, None

    def __len__(self) -> int:
        return len(self.specs)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.index:
            return self.view
        if i < self.index:
            raise RuntimeError(f"streamed tensors are read in order: asked for {i} after {self.index}")
        self.tensor = self.view = None  # let the previous tensor go before the next one is made
        while self.next <= i:  # every tensor in between is produced too (peers run the same sequence)
            tensor = self._advance()
        self.index, self.tensor, self.view = i, tensor, as_bytes(tensor)
        return self.view

    def _advance(self) -> torch.Tensor:
        """Produces the next tensor, counted before it is checked (a bad tensor was still gathered)."""
        i, self.next = self.next, self.next + 1
        s = self.specs[i]
        try:
            t = self.produce(i)
        except torch.OutOfMemoryError as e:
            raise ResourceExhausted(f"out of memory producing {s.name!r} ({s.nbytes} bytes) for the transfer: "
                                    "use smaller buckets, or free memory before publishing") from e
        except RuntimeError as e:  # a collective whose peer rank died, most often
            raise Unavailable(f"producing {s.name!r} for the transfer failed (did a rank of the trainer die?): "
                              f"{e}") from e
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise InvalidArgument(f"{s.name!r} was described as {dtype_name(s.dtype)}{list(s.shape)} but produced "
                                  f"as {dtype_name(t.dtype)}{list(t.shape)}")
        return t.contiguous()

    def tensors(self):
        """Every tensor in order (the pass ends complete)."""
        for i in range(len(self.specs)):
            self[i]
            yield self.tensor

    def finish(self) -> None:
        """Produces whatever is left, so every rank ends the pass on the same tensor."""
        self.tensor = self.view = None
        while self.next < len(self.specs):
            self._advance()

    def __enter__(self) -> Pass:
        return self

    def __exit__(self, *exc) -> None:
        """A pass left early is finished (quietly when it is already failing: its error is the one told)."""
        if exc[0] is None:
            self.finish()
            return
        try:
            self.finish()
        except Exception:  # noqa: BLE001 - see above
            pass


def run_pass(source: StreamedSource) -> None:
    """A rank's share of one pass it does not consume (it only takes part in the gathers)."""
    source.stream().finish()
