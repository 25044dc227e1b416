"""Block FP8 quantization on the GPU: one Triton program per 128 x 128 block reads the block once,
takes its amax, and writes its FP8 values and its scale (3 bytes moved per bf16 element: read 2,
write 1, the memory-bound limit). The same bits as the reference (rlsync.quant.fp8_blocks, vLLM's):
the same fp32 operations in the same order as torch runs them on a GPU: amax / 448 as a product with
the fp32 reciprocal of 448 (torch's CUDA division by a scalar; on the CPU it divides, which rounds a
scale one ulp apart now and then: the kernel equals the reference run on the GPU, as vLLM's own
quantizer does there), 1 / scale correctly rounded (div_rn: Triton's `/` is approximate).
Power-of-two scales take torch's own log2 / ceil / pow between two launches (an amax pass, then the
quantizing pass): a log2 of another library could round a scale just above a power of two the other way.
Elsewhere (CPU, no Triton) the reference itself."""

from __future__ import annotations

import torch

from rlsync.quant.fp8_blocks import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, quantize_blocks, scale_shape, scales_of

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds without Triton: the reference everywhere
    triton = None


def quantize(x: torch.Tensor, block: tuple[int, int] = BLOCK,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp8 values, fp32 scales): the kernel on a CUDA device, else the reference."""
    if _on_kernel(x):
        return quantize_cuda(x, block, pow2)
    return quantize_blocks(x, block, pow2)


def quantize_into(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = BLOCK,
                  pow2: bool = False) -> None:
    """quantize(x), written into `q` (FP8, x's shape, rows contiguous) and `s` (fp32, the scale grid):
    on a CUDA device straight from the kernel, nothing allocated; else the reference's, copied in."""
    if _on_kernel(x) and q.stride(1) == 1 and s.is_contiguous():
        _launch(x if x.stride(1) == 1 else x.contiguous(), q, s, block, pow2)
        return
    ref_q, ref_s = quantize_blocks(x, block, pow2)
    q.copy_(ref_q)
    s.copy_(ref_s)


def _on_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None and x.dim() == 2 and x.is_floating_point() and x.numel() > 0


if triton is not None:
    @triton.jit
    def _block(x_ptr, q_ptr, s_ptr, bi, bj, m, n, stride_xm, stride_qm, floor, fp8_max,
               BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr):
        """Block (bi, bj) of one weight. MODE 0: amax -> scale -> values; 1: the block's amax only (into s);
        2: values under the scale in s."""
        rows = bi * BM + tl.arange(0, BM)
        cols = bj * BN + tl.arange(0, BN)
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s_at = s_ptr + bi * tl.cdiv(n, BN) + bj
        if MODE == 1:
            tl.store(s_at, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        else:
            if MODE == 2:
                scale = tl.load(s_at)
            else:
                amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
                scale = tl.maximum(amax, floor) * tl.math.div_rn(1.0, fp8_max)  # (torch's CUDA x / scalar)
                tl.store(s_at, scale)
            inv = tl.math.div_rn(1.0, scale)
            q = (x * inv).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)

    @triton.jit
    def _quantize_block(x_ptr, q_ptr, s_ptr, m, n, stride_xm, stride_qm, floor, fp8_max,
                        BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr):
        """One weight: program (i, j) its block (i, j)."""
        _block(x_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), m, n, stride_xm, stride_qm, floor, fp8_max,
               BM, BN, MODE)

    @triton.jit
    def _pointers(row, KIND: tl.constexpr, ALIGN: tl.constexpr):
        """The addresses a table's row starts with: x (KIND 0: bf16, 1: fp16, 2: fp32), its FP8 values, its scales;
        x's and the values' said to be ALIGN-byte aligned. (Said here, on the ops that make them: a hint put on a
        helper's returned value lands on the call op, which the inliner may drop, Triton version by version.)"""
        if KIND == 0:
            x_ptr = tl.load(row).to(tl.pointer_type(tl.bfloat16))
        elif KIND == 1:
            x_ptr = tl.load(row).to(tl.pointer_type(tl.float16))
        else:
            x_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
        q_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv))
        return (tl.multiple_of(x_ptr, ALIGN), tl.multiple_of(q_ptr, ALIGN),
                tl.load(row + 2).to(tl.pointer_type(tl.float32)))

    @triton.jit
    def _quantize_many(table, owner, floor, fp8_max, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
                       KIND: tl.constexpr, ALIGN: tl.constexpr):
        """Many weights of one dtype (KIND 0: bf16, 1: fp16, 2: fp32): program b is block b of them all,
        of the weight owner[b], whose row of `table` is [x, q, s addresses, m, n, x's and q's row strides,
        its first block] (int64)."""
        b = tl.program_id(0)
        row = table + tl.load(owner + b).to(tl.int64) * 8
        x_ptr, q_ptr, s_ptr = _pointers(row, KIND, ALIGN)
        # The block's arithmetic as the one-weight kernel's, whose launch makes m, n and the strides i32 with
        # n and the strides multiples of 16: here read from memory, so made i32 (_aligned keeps to the table
        # weights whose every element offset, a masked block's too, is below 2**31; the addresses stay 64-bit)
        # and said to be multiples of ALIGN (_aligned: true of every weight in the table). As int64 they made
        # each address 64-bit multiplies and adds, and a 64-bit division per program.
        m = tl.load(row + 3).to(tl.int32)
        n = tl.multiple_of(tl.load(row + 4).to(tl.int32), ALIGN)
        stride_xm = tl.multiple_of(tl.load(row + 5).to(tl.int32), ALIGN)
        stride_qm = tl.multiple_of(tl.load(row + 6).to(tl.int32), ALIGN)
        local = b - tl.load(row + 7).to(tl.int32)
        per_row = tl.cdiv(n, BN)
        _block(x_ptr, q_ptr, s_ptr, local // per_row, local % per_row, m, n, stride_xm, stride_qm,
               floor, fp8_max, BM, BN, MODE)


def quantize_cuda(x: torch.Tensor, block: tuple[int, int] = BLOCK,
                  pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty(scale_shape(x.shape, block), dtype=torch.float32, device=x.device)
    _launch(x, q, s, block, pow2)
    return q, s


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], pow2: bool) -> None:
    """The one-weight kernel over x, in bands of whole block rows where its 32-bit offsets would not reach
    past one launch (a weight of 2**31 elements or more: each band's offsets from its own start)."""
    if not (_offsets_fit(x, block) and _offsets_fit(q, block)):
        cols = -(-x.shape[1] // block[1]) * block[1]  # (as _offsets_fit counts them: the last block whole)
        band = max(1, (_INDEX_LIMIT - cols) // max(x.stride(0), q.stride(0)) // block[0]) * block[0]
        if band >= x.shape[0]:  # (one block row alone passes it: 16M columns or more)
            raise ValueError(f"a weight of shape {tuple(x.shape)}: one row of 128 x 128 blocks passes the FP8 "
                             f"kernel's 32-bit offsets")
        for r in range(0, x.shape[0], band):
            _launch(x[r:r + band], q[r:r + band], s[r // block[0]:(r + band) // block[0]], block, pow2)
        return
    m, n = x.shape
    grid = scale_shape(x.shape, block)
    args = (x, q, s, m, n, x.stride(0), q.stride(0), AMAX_FLOOR, FP8_MAX)
    if pow2:
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=1, num_warps=8)
        s.copy_(scales_of(s, pow2=True))
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=2, num_warps=8)
    else:
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=0, num_warps=8)


_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class ManyQuantizer:
    """quantize_into for many (x, q, s), each of them: on a CUDA device one launch per input dtype from a
    table made once (the weights and outputs stay where they are, as a resident source's do), where every block
    of every weight is one program; power-of-two scales take an amax launch, torch's rounding of the scales,
    then a values launch. Elsewhere, or for a weight the table cannot take (_aligned), quantize_into one by one.
    Four warps a program: 3.10 ms for 8.8 GB on an H200 against 3.59 ms with eight (`bench/fp8_quantize.py`)."""

    def __init__(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], block: tuple[int, int] = BLOCK,
                 pow2: bool = False, num_warps: int = 4):
        self.block, self.pow2, self.num_warps = block, pow2, num_warps
        self.alone: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        by_kind: dict[int, list] = {}
        for x, q, s in items:
            if _on_kernel(x) and _aligned(x, q, s, block):
                by_kind.setdefault(_KINDS[x.dtype], []).append((x, q, s))
            else:
                self.alone.append((x, q, s))
        self.launches = [_table(kind, group, block) for kind, group in by_kind.items()]
        self.scales = [s for group in by_kind.values() for _, _, s in group]

    def run(self) -> None:
        for x, q, s in self.alone:
            quantize_into(x, q, s, self.block, self.pow2)
        for mode in ((1, 2) if self.pow2 else (0,)):
            if mode == 2:
                for s in self.scales:
                    s.copy_(scales_of(s, pow2=True))
            for kind, table, owner in self.launches:
                _quantize_many[(owner.numel(),)](table, owner, AMAX_FLOOR, FP8_MAX, BM=self.block[0], BN=self.block[1],
                                                 MODE=mode, KIND=kind, ALIGN=_ALIGN, num_warps=self.num_warps)


_ALIGN = 16


def _aligned(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] = BLOCK) -> bool:
    """A weight the one launch takes: of a dtype it reads, its and its output's rows contiguous, starting
    16-byte aligned, a multiple of 16 elements long and apart (what its kernel's hints say of them all), and
    every element offset its blocks make (a masked block's past the last row or column too) below 2**31, as
    its kernel's 32-bit index math needs."""
    return (x.dtype in _KINDS and s.is_contiguous() and x.shape[1] % _ALIGN == 0
            and all(t.stride(1) == 1 and t.stride(0) % _ALIGN == 0 and t.data_ptr() % _ALIGN == 0
                    and _offsets_fit(t, block) for t in (x, q)))


_INDEX_LIMIT = 2**31  # the kernels' element offsets are int32


def _offsets_fit(t: torch.Tensor, block: tuple[int, int]) -> bool:
    """Every offset rows * row stride + column of t's block grid (its last blocks whole) fits in an int32."""
    rows, cols = (-(-size // b) * b for size, b in zip(t.shape, block))
    return (rows - 1) * t.stride(0) + cols - 1 < _INDEX_LIMIT


def _table(kind: int, group: list, block: tuple[int, int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    rows, counts, first = [], [], 0
    for x, q, s in group:
        m, n = x.shape
        rows.append([x.data_ptr(), q.data_ptr(), s.data_ptr(), m, n, x.stride(0), q.stride(0), first])
        counts.append(s.numel())  # (the scale grid: one scale a block)
        first += counts[-1]
    device = group[0][0].device
    return kind, torch.tensor(rows, dtype=torch.int64).to(device), owners(counts, device)


def owners(counts: list[int], device: torch.device) -> torch.Tensor:
    """A table launch's program -> row index: row r owns `counts[r]` programs in a row (int32, on `device`)."""
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), torch.tensor(counts)).to(
        device, non_blocking=True)
