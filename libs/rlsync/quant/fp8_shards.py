"""Block FP8 of a weight whose ranks each hold boxes of it (FSDP2's Shard(0) rows, a tensor-parallel
column split, fused parts, replicas), equal bit for bit to quantizing the whole tensor: a block that some
rank holds only part of gets one amax, the max of the ranks' partial amaxes (max is exact in any order),
exchanged for those blocks only (one all-reduce MAX of a few scales for every weight, not a gather).
Planning is pure (`block_plan`); each scale is sent by a rank holding its block's first element."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from rlsync.errors import InvalidArgument
from rlsync.quant.fp8_blocks import BLOCK, FP8, scale_shape
from rlsync.quant.fp8_box_kernel import box_amax, box_values

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, as rlsync.transfer.routes has it


@dataclass(frozen=True)
class BlockPlan:
    """How the ranks of one weight make its scales: the blocks whose amax they exchange (`cut`: flat,
    row-major indices into the scale grid), and the boxes of the scale grid each rank declares it
    holds (`owned[rank]`: the blocks whose first element one of its boxes holds)."""

    grid: tuple[int, int]
    cut: tuple[int, ...]
    owned: tuple[tuple[Box, ...], ...]


def _overlaps(start: int, stop: int, size: int, step: int) -> dict[int, int]:
    """{block index: how many of [start, stop) fall in it} along one dimension of `size`."""
    out = {}
    for b in range(start // step, (stop - 1) // step + 1) if stop > start else ():
        out[b] = min(stop, (b + 1) * step, size) - max(start, b * step)
    return out


@lru_cache(maxsize=256)
def block_plan(shape: tuple[int, int], held: tuple[tuple[Box, ...], ...],
               block: tuple[int, int] = BLOCK) -> BlockPlan:
    """The plan for a weight of `shape` whose rank r holds the boxes `held[r]` (not overlapping each
    other; together covering the weight). A block is cut when some rank holds part of it but not all:
    every rank then joins its exchange; a block every holder holds whole needs none (replicas)."""
    grid = scale_shape(shape, block)
    (m, n), (bm, bn) = shape, block
    cut = set()
    for boxes in held:
        covered: dict[tuple[int, int], int] = {}
        for (r0, r1), (c0, c1) in boxes:
            rows, cols = _overlaps(r0, r1, m, bm), _overlaps(c0, c1, n, bn)
            for i, h in rows.items():
                for j, w in cols.items():
                    covered[i, j] = covered.get((i, j), 0) + h * w
        for (i, j), area in covered.items():
            if area < (min(m, (i + 1) * bm) - i * bm) * (min(n, (j + 1) * bn) - j * bn):
                cut.add(i * grid[1] + j)
    owned = tuple(tuple(((-(-r0 // bm), (r1 - 1) // bm + 1), (-(-c0 // bn), (c1 - 1) // bn + 1))
                        for (r0, r1), (c0, c1) in boxes
                        if r1 > r0 and c1 > c0 and -(-r0 // bm) * bm < r1 and -(-c0 // bn) * bn < c1)
                  for boxes in held)
    return BlockPlan(grid, tuple(sorted(cut)), owned)


def partial_amax(pieces: Sequence[tuple[Box, torch.Tensor]], shape: tuple[int, int],
                 block: tuple[int, int] = BLOCK, device: torch.device | None = None) -> torch.Tensor:
    """max |x| per block of the whole weight's grid over the boxes this rank holds (`pieces`: each box
    and its values), 0 where it holds nothing: before the floor, for the exchange to combine."""
    amax = torch.zeros(scale_shape(shape, block), dtype=torch.float32, device=device)
    box_amax([(x, box, amax) for box, x in checked(pieces)], block)
    return amax


def checked(pieces: Sequence[tuple[Box, torch.Tensor]]) -> Sequence[tuple[Box, torch.Tensor]]:
    """`pieces`, each box's values of the box's shape (else InvalidArgument)."""
    for ((r0, r1), (c0, c1)), x in pieces:
        if tuple(x.shape) != (r1 - r0, c1 - c0):
            raise InvalidArgument(f"values of shape {list(x.shape)} for box {[[r0, r1], [c0, c1]]}")
    return pieces


def exchange(amaxes: Sequence[torch.Tensor], plans: Sequence[BlockPlan],
             max_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The cut blocks of every weight made whole, in place: one call of `max_of` (an all-reduce MAX
    over the ranks, which every rank makes with the same weights in the same order), none when
    nothing is cut."""
    picked = [(a.view(-1), torch.tensor(p.cut, device=a.device)) for a, p in zip(amaxes, plans) if p.cut]
    if not picked:
        return
    maxed = max_of(torch.cat([flat.index_select(0, index) for flat, index in picked]))
    at = 0
    for flat, index in picked:
        flat.index_copy_(0, index, maxed[at:at + len(index)].to(flat.device))
        at += len(index)


def quantize_box(x: torch.Tensor, box: Box, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The whole weight's FP8 values of `box` (x: its values), under the whole grid's scales."""
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    box_values([(x, box, scale, q)], block)
    return q
