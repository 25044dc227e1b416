"""Weight quantization as a stage of an update: FP8 with 128 x 128 block scales, the format an engine
declares (its quantization config), exact whatever the trainer's sharding."""

from rlsync.quant.fp8_blocks import BLOCK, FP8_MAX, dequantize_blocks, quantize_blocks, scale_shape

__all__ = ["BLOCK", "FP8_MAX", "dequantize_blocks", "quantize_blocks", "scale_shape"]
