"""Routed pulls: a receiver rank on a trainer rank's GPU copies what that rank owes it straight out of
the rank's memory (CUDA IPC), one copy per piece (cast on the way when the dtypes differ), with no
group, no bucket and no staging between them. The trainer rank only says where its boxes lie (a
RankMemory, in the transfer's store) and keeps them still until each such receiver says it is done.

A pair pulls when both run on one GPU of one host and the trainer rank's boxes can all be mapped
(CUDA tensors of their boxes' shapes); every other pair goes over the routed group (routed.py). NCCL
takes no two members on one GPU, so this is also what makes colocated sharded trainers work at all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from itertools import accumulate

import torch

from rlsync.transfer.dtypes import dtype_name, dtype_of, itemsize
from rlsync.transfer.memory import open_cuda, share_cuda
from rlsync.transfer.routed import piece_name
from rlsync.transfer.routes import Layout, Routes, contains, extent, relative
from rlsync.transfer.v1 import transfer_pb2 as pb


def memory(held: Sequence[Sequence[torch.Tensor]] | None, facts: pb.Facts, shares: dict) -> pb.RankMemory:
    """A trainer rank's RankMemory: `held[t]`, the tensors of its boxes of tensor t (in its layout's
    order). No handles when any of them cannot be mapped (not on a GPU). `shares` keeps each storage's
    exported handle (and the storage) from one transfer to the next: the caller empties it when its
    tensors may move."""
    out = pb.RankMemory(facts=facts)
    if held is None or facts.device_type != "cuda":
        return out
    regions: dict[bytes, int] = {}
    for tensors in held:
        for t in tensors:
            if not t.is_cuda:
                return pb.RankMemory(facts=facts)
            region = regions.setdefault(share_cuda(t, shares), len(regions))
            out.held.append(pb.RankMemory.Held(region=region, offset=t.storage_offset(), stride=t.stride(),
                                               dtype=dtype_name(t.dtype)))
    out.ipc.extend(regions)
    return out


def same_gpu(a: pb.Facts, b: pb.Facts) -> bool:
    return (a.device_type == b.device_type == "cuda" and a.host_id == b.host_id
            and bool(set(a.gpu_uuids) & set(b.gpu_uuids)))


def split(routes: Routes, trainer: Sequence[pb.RankMemory], engine: Sequence[pb.Facts]) -> tuple[Routes, Routes]:
    """(pulled, pushed): the routes' transfers to the receivers that pull them, and to those that
    receive them over the group (every member computes the same from the same facts)."""
    def pulls(src: int, dst: int) -> bool:
        return len(trainer[src].ipc) > 0 and same_gpu(trainer[src].facts, engine[dst])
    return routes.only(pulls), routes.only(lambda src, dst: not pulls(src, dst))


def pull(routes: Routes, rank: int, trainer: Layout, memories: Sequence[pb.RankMemory], specs: Sequence,
         views: Mapping[str, torch.Tensor], device: torch.device, profile: dict[str, float] | None = None) -> int:
    """Receiver rank `rank`: copies every piece it pulls (`routes`, as split() gives them) from the
    trainer ranks' memory into its view (`routed.destinations`), and waits for the copies. Returns the
    bytes it received; `profile` gets the seconds spent mapping, copying (queued and done) and unmapping."""
    opened: dict[tuple[int, int], torch.Tensor] = {}  # (trainer rank, region) -> its bytes, mapped
    typed: dict[tuple[int, int, str], torch.Tensor] = {}  # ... and those bytes as one dtype
    nbytes, mapping, start = 0, 0.0, time.perf_counter()
    for transfer in routes.of_receiver(rank):
        held, memory_ = trainer.held[transfer.src], memories[transfer.src]
        first = list(accumulate((len(boxes) for boxes in held), initial=0))  # each tensor's first box in .held
        for p in transfer.pieces:
            j = next(j for j, box in enumerate(held[p.tensor]) if contains(box, p.box))
            box, where = held[p.tensor][j], memory_.held[first[p.tensor] + j]
            key = (transfer.src, where.region, where.dtype)
            if key not in typed:
                if key[:2] not in opened:
                    mapped = time.perf_counter()
                    opened[key[:2]] = open_cuda(memory_.ipc[where.region], device)
                    mapping += time.perf_counter() - mapped
                dtype, values = dtype_of(where.dtype), opened[key[:2]]
                typed[key] = values[:values.numel() - values.numel() % itemsize(dtype)].view(dtype)
            src = torch.as_strided(typed[key], extent(box), tuple(where.stride), where.offset)
            region = relative(p.box, box)
            dst = views[piece_name(specs[p.tensor].name, p.box)]
            dst.copy_(src[tuple(slice(a, b) for a, b in region)] if region else src, non_blocking=True)
            nbytes += dst.numel() * dst.element_size()
    if opened:
        torch.cuda.current_stream(device).synchronize()  # the copies are done before the mappings close
    copied = time.perf_counter()
    typed.clear()
    opened.clear()
    if profile is not None:
        profile.update(map=mapping, copy=copied - start - mapping, unmap=time.perf_counter() - copied)
    return nbytes
