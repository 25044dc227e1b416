"""Block FP8 of the boxes a sharded rank holds (rlsync.quant.fp8_shards' arithmetic, on the GPU): one Triton
program per block of the whole weight's grid that a box touches, over the part of the block the box holds. The
amax pass max-es each part's amax into the weight's grid (atomically: boxes of one rank may share a block; max
is exact in any order), so the grid holds what partial_amax makes; the values pass writes the box's FP8 values
under the grid's scales, as quantize_with does (x promoted to fp32, times the correctly rounded 1 / scale, one
rounding to FP8). All boxes of one input dtype go in one launch, from a table made at each call. Elsewhere (CPU,
no Triton) the reference's torch operations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlsync.quant.fp8_blocks import BLOCK
from rlsync.quant.fp8_kernel import _KINDS, owners, triton

Box = tuple[tuple[int, int], tuple[int, int]]  # [start, stop) of rows, of columns, in the whole weight

if triton is not None:
    import triton.language as tl

    from rlsync.quant.fp8_kernel import _pointers

    @triton.jit
    def _box_block(x_ptr, q_ptr, s_ptr, gi, gj, r0, r1, c0, c1, gn, stride_xm, stride_qm,
                   BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr):
        """Block (gi, gj) of the weight's grid (gn blocks a row), over the box [r0, r1) x [c0, c1) whose first
        element is x's (0, 0) and q's. MODE 1: the part's amax, max-ed into the grid; 2: its FP8 values."""
        rows = gi * BM + tl.arange(0, BM)
        cols = gj * BN + tl.arange(0, BN)
        mask = (rows[:, None] >= r0) & (rows[:, None] < r1) & (cols[None, :] >= c0) & (cols[None, :] < c1)
        local_r, local_c = rows - r0, cols - c0
        x = tl.load(x_ptr + local_r[:, None] * stride_xm + local_c[None, :], mask=mask, other=0.0).to(tl.float32)
        s_at = s_ptr + gi * gn + gj
        if MODE == 1:
            tl.atomic_max(s_at, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        else:
            inv = tl.math.div_rn(1.0, tl.load(s_at))
            q = (x * inv).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + local_r[:, None] * stride_qm + local_c[None, :], q, mask=mask)

    @triton.jit
    def _quantize_boxes(table, owner, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, KIND: tl.constexpr,
                        ALIGN: tl.constexpr):
        """Program b: block b of all the boxes, of box owner[b], whose row of `table` is [x, q, s addresses, r0,
        r1, c0, c1, gn, x's and q's row strides, its first program, its blocks a row, its first block's grid
        row and column] (int64, 16 a row). ALIGN 16: every box's addresses, strides and columns are multiples of
        16 (_aligned), which Triton cannot know of values read from memory: said, its loads become vectors."""
        b = tl.program_id(0)
        row = table + tl.load(owner + b).to(tl.int64) * 16
        x_ptr, q_ptr, s_ptr = _pointers(row, KIND, ALIGN)
        local = b - tl.load(row + 10)
        per_row = tl.load(row + 11)
        _box_block(x_ptr, q_ptr, s_ptr,
                   tl.load(row + 12) + local // per_row, tl.load(row + 13) + local % per_row,
                   tl.load(row + 3), tl.load(row + 4), tl.multiple_of(tl.load(row + 5), ALIGN),
                   tl.multiple_of(tl.load(row + 6), ALIGN), tl.load(row + 7), tl.multiple_of(tl.load(row + 8), ALIGN),
                   tl.multiple_of(tl.load(row + 9), ALIGN), BM, BN, MODE)


def _on_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None and x.dim() == 2 and x.dtype in _KINDS


def box_amax(items: Sequence[tuple[torch.Tensor, Box, torch.Tensor]], block: tuple[int, int] = BLOCK) -> None:
    """For each (x: a box's values, box, amax: its weight's grid, fp32, contiguous): max-es the amax of the part
    of each block the box holds into amax (which the caller zeroes first). The boxes of one weight share its grid."""
    from rlsync.quant.fp8_blocks import block_amax

    rest = [it for it in items if not _usable(it[0], it[2], block)]
    _launch([it for it in items if _usable(it[0], it[2], block)], 1, block)
    bm, bn = block
    for x, ((r0, r1), (c0, c1)), amax in rest:  # the reference: pad in front to the block boundary
        if r1 <= r0 or c1 <= c0:
            continue
        lead_r, lead_c = r0 % bm, c0 % bn
        if lead_r or lead_c:
            padded = x.new_zeros(lead_r + x.shape[0], lead_c + x.shape[1])
            padded[lead_r:, lead_c:] = x
            x = padded
        part = block_amax(x, block)
        at = amax[r0 // bm:r0 // bm + part.shape[0], c0 // bn:c0 // bn + part.shape[1]]
        torch.maximum(at, part.to(at.device), out=at)


def box_values(items: Sequence[tuple[torch.Tensor, Box, torch.Tensor, torch.Tensor]],
               block: tuple[int, int] = BLOCK) -> None:
    """For each (x: a box's values, box, scale: its weight's grid of scales, q: FP8, x's shape, rows contiguous):
    writes x's FP8 values under the scales into q."""
    from rlsync.quant.fp8_blocks import quantize_with

    def fits(x, grid, q) -> bool:
        return _usable(x, grid, block) and q.stride(1) == 1 and q.device == x.device

    rest = [it for it in items if not fits(it[0], it[2], it[3])]
    _launch([it for it in items if fits(it[0], it[2], it[3])], 2, block)
    for x, box, scale, q in rest:
        q.copy_(quantize_with(x, scale, block, row0=box[0][0], col0=box[1][0]))


def _usable(x: torch.Tensor, grid: torch.Tensor, block: tuple[int, int]) -> bool:
    """The kernel takes it: rows contiguous, the grid contiguous fp32 on x's device, blocks of powers of two (its
    tiles)."""
    return (_on_kernel(x) and x.stride(1) == 1 and grid.is_contiguous() and grid.dtype == torch.float32
            and grid.device == x.device and all(b & (b - 1) == 0 for b in block))


def _launch(items: list, mode: int, block: tuple[int, int]) -> None:
    """One launch per input dtype over `items` (as box_amax's, or box_values' with q last)."""
    bm, bn = block
    by_kind: dict[tuple[int, int], list] = {}
    for it in items:
        aligned = _aligned(it[0], it[1], it[3] if len(it) > 3 else None, block)
        by_kind.setdefault((_KINDS[it[0].dtype], _ALIGN if aligned else 1), []).append(it)
    for (kind, align), group in by_kind.items():
        rows, counts, first = [], [], 0  # (a program a block: `owners` says which row each reads)
        for x, ((r0, r1), (c0, c1)), grid, *q in group:
            if r1 <= r0 or c1 <= c0:
                continue
            gi0, gj0 = r0 // bm, c0 // bn
            per_row = (c1 - 1) // bn + 1 - gj0
            blocks = ((r1 - 1) // bm + 1 - gi0) * per_row
            out = q[0] if q else x  # (the amax pass writes no values: any address will do)
            rows.append([x.data_ptr(), out.data_ptr(), grid.data_ptr(), r0, r1, c0, c1, grid.shape[1],
                         x.stride(0), out.stride(0), first, per_row, gi0, gj0, 0, 0])
            counts.append(blocks)
            first += blocks
        if not first:
            continue
        device = group[0][0].device
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        _quantize_boxes[(first,)](table, owners(counts, device), BM=bm, BN=bn, MODE=mode, KIND=kind, ALIGN=align,
                                  num_warps=8)


_ALIGN = 16


def _aligned(x: torch.Tensor, box: Box, q: torch.Tensor | None, block: tuple[int, int]) -> bool:
    """A box whose kernel loads (and stores) may be vectors: its columns start and end at multiples of 16 (so
    do the blocks), and its values' (and FP8 values') rows start 16-byte aligned, a multiple of 16 apart."""
    tensors = (x,) if q is None else (x, q)
    return (box[1][0] % _ALIGN == 0 and box[1][1] % _ALIGN == 0 and block[1] % _ALIGN == 0
            and all(t.data_ptr() % _ALIGN == 0 and t.stride(0) % _ALIGN == 0 for t in tensors))
