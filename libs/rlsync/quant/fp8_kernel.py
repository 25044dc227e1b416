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
    def _quantize_block(x_ptr, q_ptr, s_ptr, m, n, stride_xm, stride_qm, floor, fp8_max,
                        BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr):
        """MODE 0: amax -> scale -> values; 1: the block's amax only (into s); 2: values under the scale in s."""
        bi = tl.program_id(0)
        bj = tl.program_id(1)
        rows = bi * BM + tl.arange(0, BM)
        cols = bj * BN + tl.arange(0, BN)
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s_at = s_ptr + bi * tl.cdiv(n, BN) + bj
        if MODE == 2:
            scale = tl.load(s_at)
        else:
            amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
            if MODE == 1:
                tl.store(s_at, amax)
                return
            scale = tl.maximum(amax, floor) * tl.math.div_rn(1.0, fp8_max)  # (torch's CUDA x / scalar)
            tl.store(s_at, scale)
        inv = tl.math.div_rn(1.0, scale)
        q = (x * inv).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask)


def quantize_cuda(x: torch.Tensor, block: tuple[int, int] = BLOCK,
                  pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty(scale_shape(x.shape, block), dtype=torch.float32, device=x.device)
    _launch(x, q, s, block, pow2)
    return q, s


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], pow2: bool) -> None:
    m, n = x.shape
    grid = scale_shape(x.shape, block)
    args = (x, q, s, m, n, x.stride(0), q.stride(0), AMAX_FLOOR, FP8_MAX)
    if pow2:
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=1, num_warps=8)
        s.copy_(scales_of(s, pow2=True))
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=2, num_warps=8)
    else:
        _quantize_block[grid](*args, BM=block[0], BN=block[1], MODE=0, num_warps=8)
