"""A module's parameters as a transfer source: as they are when they can be sent as they are; routed
from every rank's own shards when they are sharded; else produced tensor by tensor (cast, fused)
while the transfer runs.

Sharded parameters (FSDP2's fully_shard, tensor parallel) are DTensors: every rank sends the pieces
of its shards that the receivers load (`ShardedModule`, rlsync.transfer.routed); nothing is gathered
to move weights. Only an audit (GetWeightChecksums) gathers them, tensor by tensor, after casting the
local shard, in a collective every rank runs for the same tensor in the same order. FSDP2's layout
(dim 0 over a 1-D mesh) is gathered to the auditing rank only (measured on 2 gloo ranks, a 32.8 MB
tensor: 32 ms and nothing held on the other ranks, against 160 ms and 82 MB on every rank for
`full_tensor`); any other placement goes through `full_tensor`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dataclasses import dataclass

from rlsync import lora
from rlsync.errors import InvalidArgument
from rlsync.publish.layout import RankShards, publisher_ranks
from rlsync.publish.mapping import Entry, WeightMap
from rlsync.transfer.manifest import Spec
from rlsync.transfer.sharded import ShardedSender
from rlsync.transfer.source import ResidentSource, StreamedSource

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch built without distributed
    DTensor, Shard = (), ()


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if is_sharded(t) else t.device


def module_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers, by name."""
    tensors = dict(model.named_parameters())
    persistent = {n for n, _ in model.named_buffers()} - _non_persistent(model)
    tensors.update((n, b) for n, b in model.named_buffers() if n in persistent)
    return tensors


def _non_persistent(model: nn.Module) -> set[str]:
    out = set()
    for prefix, module in model.named_modules():
        for b in getattr(module, "_non_persistent_buffers_set", ()):
            out.add(f"{prefix}.{b}" if prefix else b)
    return out


def _whole(t: torch.Tensor, dtype: torch.dtype, dst: int = 0) -> torch.Tensor:
    """`t` whole on rank `dst`, in `dtype`. Other ranks take part in the gather and get a tensor of
    the right shape on the meta device (no memory) when they do not need the values."""
    t = t.detach()
    if t.dtype != dtype:
        t = t.to(dtype)  # a DTensor casts its local shard: the gather then moves the smaller dtype
    if not is_sharded(t):
        return t
    if t.device_mesh.ndim == 1 and len(t.placements) == 1 and isinstance(t.placements[0], Shard) \
            and t.placements[0].dim == 0:
        return _gather_rows(t, dst)
    return t.full_tensor()


def _gather_rows(t, dst: int) -> torch.Tensor:
    """A dim-0-sharded DTensor gathered to global rank `dst` (shards padded to equal size, as
    torch.chunk splits them)."""
    group, world, rows = t.device_mesh.get_group(), t.device_mesh.size(), t.shape[0]
    local = t.to_local()
    if t.numel() == 0:  # nothing to move; every rank knows the shape
        return local.new_empty(t.shape)
    chunk = -(-rows // world)
    if local.shape[0] != chunk:
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[:local.shape[0]] = local
        local = padded
    if dist.get_rank() == dst:
        out = local.new_empty((chunk * world, *local.shape[1:]))
        dist.gather(local.contiguous(), list(out.chunk(world)), dst=dst, group=group)
        return out[:rows]
    dist.gather(local.contiguous(), None, dst=dst, group=group)
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


@dataclass
class ShardedModule:
    """A sharded model: this rank's shards (what it sends; see RankShards) and, for audits only, the
    same tensors gathered one at a time (`audit`: a pass every rank walks)."""

    shards: RankShards
    specs: list[Spec]
    audit: StreamedSource
    device: torch.device
    adapter = None
    frozen: dict = None

    def sender(self, **kwargs) -> ShardedSender:
        return ShardedSender(self.shards.layout, self.specs, self.shards.rank, self.shards.piece,
                             device=self.device, **kwargs)


def module_source(model: nn.Module, weights: WeightMap | None = None, dst: int = 0, group=None) \
        -> tuple[ResidentSource | StreamedSource | ShardedModule, list[Entry]]:
    """The source to send `model` through (a sharded one from every rank of `group`; else from global
    rank `dst`), and the plan of each engine tensor."""
    weights = weights or WeightMap()
    tensors = module_tensors(model)
    adapter = lora.adapter_of(model)
    frozen: dict[str, torch.Tensor] = {}
    if adapter is not None:  # a peft model: the adapter is sent, its frozen base only audited
        tensors, frozen = lora.split({WeightMap().engine_name(n): t for n, t in tensors.items()})  # wrappers off
        if any(is_sharded(t) for t in (*tensors.values(), *frozen.values())):
            raise InvalidArgument("LoRA adapters of sharded models (FSDP2, tensor parallel) are not published yet: "
                                  "publish the merged weights, or train the adapter on an unsharded model")
        if weights.rename is not None or weights.include or weights.exclude or weights.fuse or weights.tied:
            raise InvalidArgument("a LoRA adapter is published under peft's names: of WeightMap, only dtype applies "
                                  "(drop rename, include, exclude, fuse and tied)")
    entries = weights.plan([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    devices = {local_device(tensors[p]) for e in entries for p in e.parts}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters live on several devices ({sorted(map(str, devices))}): "
                         "publish from one device per rank")
    device = devices.pop()
    as_is = all(len(e.parts) == 1 and not is_sharded(tensors[e.parts[0]]) and tensors[e.parts[0]].dtype == e.dtype
                and tensors[e.parts[0]].is_contiguous() for e in entries)
    if as_is:
        return ResidentSource({e.name: tensors[e.parts[0]].detach() for e in entries}, adapter=adapter,
                              frozen=frozen), entries

    def produce(i: int) -> torch.Tensor:
        e = entries[i]
        parts = [_whole(tensors[p], e.dtype, dst) for p in e.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    specs = [Spec(e.name, e.dtype, e.shape, _nbytes(e)) for e in entries]
    streamed = StreamedSource(specs, device, produce, adapter=adapter, frozen=frozen)
    if not any(is_sharded(tensors[p]) for e in entries for p in e.parts):
        return streamed, entries
    rank, world, global_ranks = publisher_ranks(group)
    shards = RankShards(tensors, entries, rank, world, global_ranks)
    return ShardedModule(shards, specs, streamed, device, frozen={}), entries


def _nbytes(e: Entry) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n * torch.empty((), dtype=e.dtype).element_size()
