"""Blockwise FP8 (e4m3) quantization of a 2-D weight, bit for bit as vLLM's reference does it
(vllm.utils.deep_gemm.per_block_cast_to_fp8, which DeepGEMM's tests and vLLM's block-FP8 tests use):

    amax  = max |x| over the block, in fp32, clamped below at 1e-4
    scale = amax / 448                      (rounded up to a power of two first when asked: UE8M0;
                                             torch on a GPU multiplies by the fp32 reciprocal instead,
                                             so the reference equals vLLM's on the device it runs on)
    q     = fp8(x * (1 / scale))            (x promoted to fp32; one rounding, to nearest even)

`scale` is what checkpoints store as `weight_scale_inv` (x ~ q * scale), fp32, one per block:
[ceil(out / 128), ceil(in / 128)]; edge blocks are partial (the reference pads with zeros, which
no amax sees). Pure torch: the CPU reference, and the fallback on any device.
"""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
AMAX_FLOOR = 1e-4  # vLLM's clamp: an all-zero block gets scale 1e-4 / 448, never 0


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The scale grid of a 2-D weight of `shape`: one fp32 per block, edge blocks partial."""
    _check_2d(shape, block)
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _check_2d(shape, block) -> None:
    if len(shape) != 2:
        raise InvalidArgument(f"block FP8 quantizes 2-D weights; got shape {list(shape)}")
    if len(block) != 2 or min(block) < 1:
        raise InvalidArgument(f"block size must be two positive integers, got {list(block)}")


def block_amax(x: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """max |x| per block, fp32, [ceil(m / bm), ceil(n / bn)], before the floor: what ranks holding
    parts of a block combine (max is exact in any order)."""
    _check_2d(x.shape, block)
    m, n = x.shape
    gm, gn = scale_shape(x.shape, block)
    bm, bn = block
    if m % bm or n % bn:  # zeros pad the edge blocks, as the reference does (|0| never raises a max)
        padded = torch.zeros(gm * bm, gn * bn, dtype=x.dtype, device=x.device)
        padded[:m, :n] = x
        x = padded
    return x.view(gm, bm, gn, bn).abs().float().amax(dim=(1, 3))


def scales_of(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """The scale of each block from its amax: amax / 448, rounded up to a power of two before any
    value is quantized when `pow2` (engines whose GEMMs take UE8M0 scales)."""
    scale = amax.clamp(AMAX_FLOOR) / FP8_MAX
    return torch.pow(2.0, torch.ceil(torch.log2(scale.abs()))) if pow2 else scale


def quantize_with(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK,
                  row0: int = 0, col0: int = 0) -> torch.Tensor:
    """x's FP8 values under block scales `scale` (the whole tensor's grid); `row0`, `col0`: where x's
    first element lies in the whole tensor (a shard), so each element meets its block's scale."""
    bm, bn = block
    rows = torch.arange(row0, row0 + x.shape[0], device=x.device) // bm
    inv = (1.0 / scale)[rows].repeat_interleave(bn, dim=1)[:, col0:col0 + x.shape[1]]
    return (x * inv).to(FP8)


def quantize_blocks(x: torch.Tensor, block: tuple[int, int] = BLOCK,
                    pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp8 weight of x's shape, fp32 weight_scale_inv [ceil(m / bm), ceil(n / bn)])."""
    if not x.is_floating_point():
        raise InvalidArgument(f"only floating-point weights are quantized, got {x.dtype}")
    scale = scales_of(block_amax(x, block), pow2)
    return quantize_with(x, scale, block), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q * scale per block, in fp32, then cast to `dtype` (as transformers' Fp8Dequantize does)."""
    if tuple(scale.shape) != scale_shape(q.shape, block):
        raise InvalidArgument(f"scales of shape {list(scale.shape)} do not fit a {list(q.shape)} weight in "
                              f"{list(block)} blocks (expected {list(scale_shape(q.shape, block))})")
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return (q.float() * full).to(dtype)
