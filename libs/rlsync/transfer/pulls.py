"""Routed pulls: a receiver rank on a trainer rank's GPU copies what that rank owes it straight out of
the rank's memory (CUDA IPC), every piece in one kernel launch where it can (cast on the way when the
dtypes differ), with no group, no bucket and no staging between them. The trainer rank only says where
its boxes lie (a RankMemory, in the transfer's store) and keeps them still until each such receiver
says it is done.

A pair pulls when both run on one GPU of one host and the trainer rank's boxes can all be mapped
(CUDA tensors of their boxes' shapes); every other pair goes over the routed group (routed.py). NCCL
takes no two members on one GPU, so this is also what makes colocated sharded trainers work at all.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import accumulate

import numpy as np
import torch

from rlsync.transfer import batched
from rlsync.transfer.dtypes import dtype_name, dtype_of, itemsize
from rlsync.transfer.held import HELD
from rlsync.transfer.kept import Kept, staging_layout
from rlsync.transfer.memory import open_cuda, share_cuda
from rlsync.transfer.routed import destinations, piece_name
from rlsync.transfer.routes import Box, Layout, Routes, contains, extent, relative
from rlsync.transfer.spans import FEW, cast_all, copy_all
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
    out.regions = len(regions)
    return out


def summary(memory: pb.RankMemory) -> pb.RankMemory:
    """What every member of the transfer reads of a trainer rank's memory: where it runs, whether any
    of it can be mapped, the groups it holds (no handles, no boxes: those only the receiver ranks
    that pull from it read)."""
    return pb.RankMemory(facts=memory.facts, regions=memory.regions, groups=memory.groups)


def same_gpu(a: pb.Facts, b: pb.Facts) -> bool:
    return (a.device_type == b.device_type == "cuda" and a.host_id == b.host_id
            and bool(set(a.gpu_uuids) & set(b.gpu_uuids)))


_SPLITS = Kept(8)  # a repeat update splits the same routes by the same facts: the same two Routes objects


def split(routes: Routes, trainer: Sequence[pb.RankMemory], engine: Sequence[pb.Facts]) -> tuple[Routes, Routes]:
    """(pulled, pushed): the routes' transfers to the receivers that pull them, and to those that
    receive them over the group (every member computes the same from the same facts; `trainer`: each
    rank's memory or its summary). Kept by the routes (the plan's own object, kept alive by the entry, so
    its id names it) and every member's facts: a repeat gets the very objects it got last time."""
    key = (id(routes), *((m.regions > 0, m.facts.SerializeToString()) for m in trainer),
           *(f.SerializeToString() for f in engine))
    return _SPLITS.get(key, lambda: (routes, _split(routes, trainer, engine)))[1]


def _split(routes: Routes, trainer: Sequence[pb.RankMemory], engine: Sequence[pb.Facts]) -> tuple[Routes, Routes]:
    by_gpu: dict[tuple[str, str], set[int]] = defaultdict(set)  # pairs are many (K x E), GPUs few
    for dst, facts in enumerate(engine):
        if facts.device_type == "cuda":
            for gpu in facts.gpu_uuids:
                by_gpu[(facts.host_id, gpu)].add(dst)
    near = [set().union(*(by_gpu.get((m.facts.host_id, gpu), ()) for gpu in m.facts.gpu_uuids))
            if m.regions > 0 and m.facts.device_type == "cuda" else set() for m in trainer]
    return routes.only(lambda src, dst: dst in near[src]), routes.only(lambda src, dst: dst not in near[src])


def pull(routes: Routes, rank: int, trainer: Layout, memories: Mapping[int, pb.RankMemory], specs: Sequence,
         staging: Mapping[str, tuple[Box, torch.Tensor]], device: torch.device,
         profile: dict[str, float] | None = None, hold: str = "", wait: bool = True,
         laid: tuple[tuple, np.ndarray] | None = None, launched: dict | None = None, dry: bool = False) -> int:
    """Receiver rank `rank`: copies every piece it pulls (`routes`: as split() gives them, or all of them for a
    rank that holds every storage it pulls from, RoutedReceiver's armed repeat) from the trainer ranks' memory
    (`memories`: the whole RankMemory of each rank it pulls from, by trainer rank, each with its digest) into its
    view of `staging` (`routed.destinations`), and with `wait` waits for the copies.
    Returns the bytes it received; `profile` gets the seconds spent mapping, copying (queued and done;
    only queued without `wait`: "queue") and unmapping.

    The pieces that are contiguous at both ends go in one kernel launch over a table of them, casting
    fp32 to bf16 on the way where asked (rlsync.transfer.batched); the rest are a copy_ each.

    hold: the trainer ranks' storages stay mapped afterwards under this holder name (rlsync.transfer.held):
    the next pull from memory still in place maps and closes nothing, and one into the same staging
    launches the table it kept (making no view of a piece); one from the same layout mapped anew (after the
    trainer's onload) or into a staging laid out alike elsewhere launches that table rebased. The caller
    must `HELD.release(hold)` before the trainer's memory may leave the GPU (memory another process maps
    is not freed). wait=False (every storage held): returns once the copies are queued, on the current stream.
    laid: kept.staging_layout(staging), when the caller kept it.
    launched: where a held pull that went in whole tables says what it launched ("tables", "handles": the
    storages they read, in order), for a caller that queues it again as it is (rlsync.transfer.relaunch).
    dry: copies, holds and maps nothing; when every storage is held, the tables a held pull would launch, if they
    can be had without one (kept, or moved from the latest of the layout), are made and said in `launched` (else
    it stays empty)."""
    start = time.perf_counter()
    mine = routes.of_receiver(rank)
    sources = sorted({t.src for t in mine})
    handles = [h for k in sources for h in memories[k].ipc]
    if hold and not dry:
        HELD.hold(hold, handles, device)
    found = HELD.get_many(handles)
    if dry and any(t is None for t in found):
        return 0
    mapped = [open_cuda(h, device) if t is None else t for h, t in zip(handles, found)]  # what no holder keeps
    mapping = time.perf_counter() - start
    kept = key = None
    laid_out = rebased = start
    if all(t is not None for t in found):  # held: the launch kept for the same pieces (their tuples, shared by
        # every Routes derived from one plan: kept alive by the entry, so no other tuple takes their ids), the same
        # layout of the trainer's memory and of the staging, at the same addresses; or, at others (the trainer's
        # memory mapped anew after its onload, a staging woken anew), the latest such launch moved there
        pieces = [t.pieces for t in mine]
        laid, dst = laid or staging_layout(staging)
        src = np.array([t.data_ptr() for t in mapped], dtype=np.int64)
        layout = (rank, *map(id, pieces), *(held_shape(memories[k]) for k in sources), laid)
        key = (layout, src.tobytes(), dst.tobytes())
        kept = _TABLES.peek(key)
        laid_out = time.perf_counter()
        if kept is None and (kept := _moved(layout, src, dst)) is not None:
            _TABLES.put(key, kept)
        rebased = time.perf_counter()
    entry = kept  # what was launched, when it went in whole tables
    if kept is not None:
        if not dry:
            for table in kept[1]:
                batched.launch(table)
        nbytes = kept[2]
    elif dry:
        nbytes = 0
    else:
        _, views = destinations(routes, rank, specs, staging)
        tables, nbytes = _copy(mine, trainer, memories, specs, views, dict(zip(
            ((k, r) for k in sources for r in range(len(memories[k].ipc))), mapped)), kept=key is not None)
        if key is not None and tables is not None:
            entry = pieces, tables, nbytes
            _TABLES.put(key, entry)
            _LATEST.put(layout, (src, dst, entry))
    if entry is not None and launched is not None:
        launched.update(tables=tuple(entry[1]), handles=tuple(handles))
    if handles and wait:
        torch.cuda.current_stream(device).synchronize()  # the copies are done before the trainer rank moves on
    copied = time.perf_counter()
    del mapped, found  # mappings no holder keeps close here
    if profile is not None:
        profile.update({"map": mapping, "copy" if wait else "queue": copied - start - mapping,
                        "unmap": time.perf_counter() - copied})
        if kept is not None:  # parts of the copy or queue: the held launch's key, and its table moved
            stage = "copy" if wait else "queue"
            profile.update({f"{stage}.key": laid_out - start - mapping, f"{stage}.rebase": rebased - laid_out})
    return nbytes


_TABLES = Kept(8)  # a held pull's (pieces, tables, bytes) by its layout and addresses (see pull)
_LATEST = Kept(4)  # by its layout alone: the addresses of the regions it read and wrote, and that pull's entry


def _moved(layout: tuple, src: np.ndarray, dst: np.ndarray) -> tuple | None:
    """The latest held pull of `layout` at other addresses, its tables moved to these regions (read at `src`,
    written at `dst`); None if none was kept, or if a region moved by other than a multiple of the
    alignment the kernels take (batched.ALIGN: checked at the tables' making; allocations are aligned far
    more, so this is a guard)."""
    latest = _LATEST.peek(layout)
    if latest is None:
        return None
    old_src, old_dst, (pieces, tables, nbytes) = latest
    if ((src - old_src) % batched.ALIGN).any() or ((dst - old_dst) % batched.ALIGN).any():
        return None
    return pieces, [batched.rebased(t, old_src, src, dst=(old_dst, dst)) for t in tables], nbytes


_SHAPES = Kept(16)  # a trainer rank's memory digest -> its layout's (held_shape)


def held_shape(memory: pb.RankMemory) -> str:
    """A trainer rank's memory as a pull's tables depend on it, not where it lies: the places of its boxes in
    its regions, and the regions' sizes (equal again after its onload, at other addresses: the tables are
    then rebased, not made anew). Found once per memory digest."""
    if not memory.digest:
        raise ValueError("a held pull keys what it keeps by each trainer rank's memory digest: this one has none")

    def shape() -> str:
        sizes = [pb.CudaIpcHandle.FromString(h).storage_size_bytes for h in memory.ipc]
        raw = pb.RankMemory(held=memory.held, regions=memory.regions).SerializeToString()
        return hashlib.sha256(raw + np.array(sizes, dtype=np.int64).tobytes()).hexdigest()
    return _SHAPES.get(memory.digest, shape)


def _copy(transfers: Sequence, trainer: Layout, memories: Mapping[int, pb.RankMemory], specs: Sequence,
          views: Mapping[str, torch.Tensor], opened: Mapping[tuple[int, int], torch.Tensor], kept: bool) \
        -> tuple[list[batched.Table] | None, int]:
    """Queues the copies of pull() of `transfers` (the receiver rank's): (the tables launched, when
    every piece went in one; the bytes).
    kept: the tables will be launched again, so even a few pieces go in one."""
    typed: dict[tuple[int, int, str], torch.Tensor] = {}  # (trainer rank, region, dtype) -> its bytes as that dtype
    copies, casts, rest, nbytes = [], [], [], 0
    for transfer in transfers:
        held, memory_ = trainer.held[transfer.src], memories[transfer.src]
        first = list(accumulate((len(boxes) for boxes in held), initial=0))  # each tensor's first box in .held
        for p in transfer.pieces:
            j = next(j for j, box in enumerate(held[p.tensor]) if contains(box, p.box))
            box, where = held[p.tensor][j], memory_.held[first[p.tensor] + j]
            key = (transfer.src, where.region, where.dtype)
            if key not in typed:
                dtype, values = dtype_of(where.dtype), opened[key[:2]]
                typed[key] = values[:values.numel() - values.numel() % itemsize(dtype)].view(dtype)
            src = torch.as_strided(typed[key], extent(box), tuple(where.stride), where.offset)
            region = relative(p.box, box)
            src = src[tuple(slice(a, b) for a, b in region)] if region else src
            dst = views[piece_name(specs[p.tensor].name, p.box)]
            nbytes += dst.numel() * dst.element_size()
            if not (src.numel() and src.is_contiguous() and dst.is_contiguous()):
                rest.append((src, dst))
            elif src.dtype == dst.dtype:
                copies.append((src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)))
            else:
                casts.append((src.reshape(-1), dst.reshape(-1)))
    few = 1 if kept else FEW
    tables = [copy_all(copies, few=few) if copies else None, cast_all(casts, few) if casts else None]
    for src, dst in rest:
        dst.copy_(src, non_blocking=True)
    whole = not rest and (tables[0] is not None or not copies) and (tables[1] is not None or not casts)
    return ([t for t in tables if t is not None] if whole else None), nbytes
