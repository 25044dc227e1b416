"""Block FP8 of a weight whose rows are sharded over ranks (FSDP2's Shard(0)), equal bit for bit to
quantizing the whole tensor: a 128-row block that two ranks' rows cut gets one amax, the max of the
ranks' partial amaxes (max is exact in any order), exchanged for the cut blocks only (an all-reduce
of a few scale rows, not a gather of the weight). Planning is pure (`shared_block_rows`)."""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument
from rlsync.quant.fp8_blocks import BLOCK, block_amax, quantize_with, scale_shape, scales_of


def shared_block_rows(ranges: list[tuple[int, int]], block_rows: int = BLOCK[0]) -> list[int]:
    """The block rows that the row ranges [start, stop) of more than one rank touch, ascending."""
    touched: dict[int, int] = {}
    for start, stop in ranges:
        if stop > start:
            for b in range(start // block_rows, (stop - 1) // block_rows + 1):
                touched[b] = touched.get(b, 0) + 1
    return sorted(b for b, n in touched.items() if n > 1)


def owned_block_rows(ranges: list[tuple[int, int]], rank: int, block_rows: int = BLOCK[0]) -> range:
    """The scale rows `rank` sends: those of the blocks whose first row it holds (one owner each)."""
    start, stop = ranges[rank]
    if stop <= start:
        return range(0)
    return range(-(-start // block_rows), (stop - 1) // block_rows + 1)


def quantize_row_shard(local: torch.Tensor, ranges: list[tuple[int, int]], rank: int, columns: int,
                       group=None, block: tuple[int, int] = BLOCK,
                       pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor, range]:
    """This rank's rows of the whole tensor's FP8 values, and the scale rows it owns (`owned_block_rows`)
    -> (fp8 rows, fp32 scales [len(owned), ceil(columns / block[1])], owned). `ranges`: every rank's rows
    of the whole tensor, in rank order; every rank of `group` calls this, for every sharded weight, in
    the same order (one all-reduce when a block is cut; none otherwise)."""
    import torch.distributed as dist

    start, stop = ranges[rank]
    if tuple(local.shape) != (stop - start, columns):
        raise InvalidArgument(f"rank {rank} holds rows [{start}, {stop}) of {columns} columns, its shard is "
                              f"{list(local.shape)}")
    rows = max(b for _, b in ranges)
    bm = block[0]
    grid = scale_shape((max(rows, 1), columns), block)
    amax = torch.zeros(grid, dtype=torch.float32, device=local.device)
    if stop > start:  # pad in front to the block boundary: the partial amax lands on the whole tensor's grid
        lead = start % bm
        padded = torch.cat([local.new_zeros(lead, columns), local]) if lead else local
        first = start // bm
        part = block_amax(padded, block)
        amax[first:first + part.shape[0]] = part
    shared = shared_block_rows(ranges, bm)
    if shared:
        index = torch.tensor(shared, device=local.device)
        cut = amax.index_select(0, index)
        dist.all_reduce(cut, op=dist.ReduceOp.MAX, group=group)
        amax.index_copy_(0, index, cut)
    scale = scales_of(amax, pow2)
    owned = owned_block_rows(ranges, rank, bm)
    q = quantize_with(local, scale, block, row0=start) if stop > start else local.new_empty(0, columns).to(
        torch.float8_e4m3fn)
    return q, scale[owned.start:owned.stop].contiguous(), owned


def fsdp_row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """The rows each rank holds under FSDP2's Shard(0) (torch.chunk: ceil(rows / world) each, the last short,
    trailing ranks empty)."""
    chunk = -(-rows // world) if rows else 0
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]
