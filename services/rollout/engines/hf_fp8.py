"""The hf engine's FP8 weights: linear layers that hold block-FP8 values and their scales as
parameters (so the flat store, updates, swaps and audits see the FP8 bytes exactly as sent) and
dequantize per block at each forward (on CPU: no FP8 matmul; on a GPU the same, for now).

Which layers, and the block size, come from the checkpoint's own quantization config and tensors
(rlsync.quant.fp8_format); transformers loads such a checkpoint dequantized on CPU, and the layers it
lists are put back to the checkpoint's FP8 values here."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlsync.quant.fp8_blocks import FP8, dequantize_blocks, scale_shape
from rlsync.quant.fp8_format import fp8_format, is_fp8_config, quantization_config, scale_name
from rlsync.transfer.v1 import transfer_pb2 as pb


class Fp8BlockLinear(nn.Module):
    """y = x W^T (+ b), W = weight * weight_scale_inv per block, in x's dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype != FP8 or tuple(scale.shape) != scale_shape(weight.shape, block):
            raise ValueError(f"FP8 weight {weight.dtype}{list(weight.shape)} with scales {list(scale.shape)} does not "
                             f"fit blocks {list(block)}")
        self.block = block
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale.float(), requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_blocks(self.weight, self.weight_scale_inv, self.block, x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def to_fp8(model: nn.Module, path: str) -> pb.WeightFormat | None:
    """Puts the checkpoint's FP8 layers back in `model` (loaded dequantized) -> the engine's format, or
    None for a model without an FP8 quantization config."""
    quant = quantization_config(path)
    if not is_fp8_config(quant):
        return None
    linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tensors = checkpoint_tensors(path)
    fmt = fp8_format(quant, linears, tensors.keys())
    block = tuple(fmt.fp8.block)
    for weight in fmt.fp8.weights:
        module_name = weight.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        q = tensors.get(weight)
        scale = tensors.get(scale_name(weight))
        if q is None or scale is None or q.dtype != FP8:  # a bf16 checkpoint the config says to quantize
            from rlsync.quant.fp8_blocks import quantize_blocks
            q, scale = quantize_blocks(old.weight.detach(), block, fmt.fp8.pow2_scales)
        setattr(parent, child, Fp8BlockLinear(q, scale, block, None if old.bias is None else old.bias.detach()))
    return fmt
