"""Weight quantization as a stage of an update: FP8 with 128 x 128 block scales (fp8_blocks: the
reference; fp8_kernel: the GPU kernel), the format an engine declares (fp8_format: torch-free, the
coordinator reads it), exact whatever the trainer's sharding (fp8_shards)."""
