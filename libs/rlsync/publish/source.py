"""A module's parameters as a transfer source: as they are when they can be sent as they are; from
every rank's own shards when they are sharded; else produced tensor by tensor (cast, fused) while
the transfer runs.

Sharded parameters (FSDP2's fully_shard, tensor parallel) are DTensors: every rank sends the pieces
of its shards that the receivers load (`ShardedModule`, rlsync.transfer.routed), and an audit adds
up every rank's share of each checksum. Nothing is ever gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlsync import lora
from rlsync.checkpoint_names import expert_rules
from rlsync.errors import InvalidArgument
from rlsync.publish.layout import RankShards, publisher_ranks
from rlsync.publish.mapping import Entry, WeightMap
from rlsync.transfer.manifest import Spec
from rlsync.transfer.sharded import ShardedSender
from rlsync.transfer.source import ResidentSource, StreamedSource
from rlsync.transfer.v1 import transfer_pb2 as pb

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()


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


@dataclass
class ShardedModule:
    """A sharded model: this rank's shards, what every rank holds (see RankShards; or the quantizing
    stage's QuantizedShards over them), and the tensors the engine receives. Every rank sends its own
    pieces, and adds its share to an audit's checksums."""

    shards: RankShards
    specs: list[Spec]
    device: torch.device
    format: pb.WeightFormat | None = None  # what its tensors were quantized to (rlsync.publish.quantized)
    quantized: frozenset[str] = frozenset()  # the names of those tensors (audited as sent, never cast)

    def sender(self, **kwargs) -> ShardedSender:
        sender = ShardedSender(self.shards.layout, self.specs, self.shards.rank, self.shards.piece,
                               device=self.device, held=self.shards.held_tensors, where=self.shards.where,
                               source=getattr(self.shards, "piece_source", None),  # (none where pieces are made)
                               **kwargs)
        sender.format = self.format
        return sender

    def refresh(self, ranks) -> None:
        """Every rank, before its pieces of a send or an audit are cut: brings what it sends up to date
        with the weights (the quantizing stage's scales: one all-reduce over `ranks`, rlsync.publish.ranks)."""
        self.shards.refresh(ranks)


def module_source(model: nn.Module, weights: WeightMap | None = None, group=None, stacked: bool = False) \
        -> tuple[ResidentSource | StreamedSource | ShardedModule, list[Entry]]:
    """The source to send `model` through (a sharded one, from every rank of `group`), and the plan
    of each engine tensor. `stacked`: the replicas take fused experts parameters stacked (WeightFormat.
    stacked_experts), which are then sent so, but for one a rank holds rows of that cut a source's rows (a
    Shard(1) that no stacked box describes: per expert, as to other replicas)."""
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
    experts = () if adapter is not None else expert_rules(model)
    whole = [n for n, t in tensors.items() if stacked and not _cuts_rows(t)] if experts else []
    entries = weights.plan([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], experts, whole)
    devices = {local_device(tensors[p]) for e in entries for p in e.parts}
    if len(devices) > 1:
        raise ValueError(f"the model's parameters live on several devices ({sorted(map(str, devices))}): "
                         "publish from one device per rank")
    device = devices.pop()
    as_is = all(len(e.parts) == 1 and not is_sharded(tensors[e.parts[0]]) and tensors[e.parts[0]].dtype == e.dtype
                and tensors[e.parts[0]].is_contiguous() for e in entries)
    if as_is:  # (an expert's view of a contiguous fused parameter is contiguous too)
        return ResidentSource({e.name: _viewed(tensors[e.parts[0]].detach(), e) for e in entries}, adapter=adapter,
                              frozen=frozen), entries

    specs = [Spec(e.name, e.dtype, e.shape, _nbytes(e)) for e in entries]
    if any(is_sharded(tensors[p]) for e in entries for p in e.parts):
        rank, world, global_ranks = publisher_ranks(group)
        return ShardedModule(RankShards(tensors, entries, rank, world, global_ranks), specs, device), entries

    def produce(i: int) -> torch.Tensor:  # one process: cast and fused on the fly
        parts = [_viewed(tensors[p].detach(), entries[i]).to(entries[i].dtype) for p in entries[i].parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # Every tensor one whole parameter, only cast: a receiver on the GPU can cast as it copies. The
    # parameters themselves, not detached aliases: an offload re-points their data, and an alias would
    # keep the old storage on the GPU (and its old values)
    cast_only = all(len(e.parts) == 1 and e.view is None and tensors[e.parts[0]].is_contiguous() for e in entries)
    originals = [tensors[e.parts[0]] for e in entries] if cast_only else None
    return StreamedSource(specs, device, produce, adapter=adapter, frozen=frozen, originals=originals), entries


def _cuts_rows(t: torch.Tensor) -> bool:
    """Whether `t` is sharded along dim 1 (the dimension a stacked experts parameter splits)."""
    return is_sharded(t) and any(getattr(p, "dim", None) == 1 for p in t.placements)


def _viewed(t: torch.Tensor, e: Entry) -> torch.Tensor:
    return t if e.view is None else e.view.of(t)


def _nbytes(e: Entry) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n * torch.empty((), dtype=e.dtype).element_size()
