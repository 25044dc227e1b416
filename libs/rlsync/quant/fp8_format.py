"""Which weights an engine holds in block FP8, and how, from the engine's own quantization config
(config.json's `quantization_config`) and checkpoint: never a hand list. The answer travels as
rlsync.transfer.v1.WeightFormat (RolloutInfo.weight_format -> OfferWeightsRequest.format ->
Manifest.format)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from rlsync.errors import InvalidArgument
from rlsync.transfer.v1 import transfer_pb2 as pb

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" -> "<module>.weight_scale_inv"
FORMATS = {"e4m3": "float8_e4m3fn"}
# Stay in the trainer's dtype whatever the config lists: transformers and vLLM never quantize these
# (the output head, and MoE routers, whose logits pick experts).
NEVER = ("lm_head", "*.mlp.gate", "*.router", "*.router.*")


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def quantization_config(model: str) -> dict | None:
    """A local checkpoint's own `quantization_config` (its config.json's; transformers drops it from a model it
    loaded dequantized), or None: unquantized, or a hub id (the engine reads its config itself)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("quantization_config")


def is_fp8_config(quant: Mapping[str, Any] | None) -> bool:
    return bool(quant) and quant.get("quant_method") == "fp8"


def parse_fp8(quant: Mapping[str, Any], pow2_scales: bool = False) -> pb.Fp8Blocks:
    """The format a `quantization_config` of quant_method "fp8" describes (weights not yet listed);
    refuses, saying why, what rlsync cannot send exactly."""
    if not is_fp8_config(quant):
        raise InvalidArgument(f"not an FP8 quantization config: quant_method {quant.get('quant_method')!r}")
    fmt = quant.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise InvalidArgument(f"FP8 format {fmt!r} is not supported: only e4m3 (float8_e4m3fn) weights are sent")
    block = quant.get("weight_block_size")
    if block is None:
        raise InvalidArgument("FP8 without weight_block_size (one scale per tensor) is not supported: rlsync sends "
                              "block-scaled FP8 (weight_block_size [128, 128])")
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise InvalidArgument(f"weight_block_size must be two positive integers, got {block!r}")
    ue8m0 = quant.get("scale_fmt") == "ue8m0"  # DeepSeek-V3.1-style checkpoints: power-of-two scales
    return pb.Fp8Blocks(fmt=fmt, block=list(block), scale_dtype="float32", pow2_scales=pow2_scales or ue8m0)


def _skipped(module: str, quant: Mapping[str, Any]) -> bool:
    """Whether `module` stays unquantized under the config's own lists (transformers' names it
    modules_to_not_convert, vLLM's ignored_layers; an entry names a module or a prefix of it)."""
    listed = list(quant.get("modules_to_not_convert") or []) + list(quant.get("ignored_layers") or [])
    for entry in listed:
        if module == entry or module.startswith(entry + ".") or fnmatchcase(module, entry) \
                or f".{entry}." in f".{module}.":
            return True
    return any(fnmatchcase(module, p) for p in NEVER)


def fp8_format(quant: Mapping[str, Any], linears: Iterable[str], checkpoint: Iterable[str] = (),
               pow2_scales: bool = False) -> pb.WeightFormat:
    """The engine's format: `linears` are the weights of its linear layers ("<module>.weight", 2-D)
    in its order. A pre-quantized checkpoint says itself which are FP8 (those with a
    "<module>.weight_scale_inv" in `checkpoint`); else the config's lists decide."""
    fp8 = parse_fp8(quant, pow2_scales)
    linears = list(linears)
    names = set(checkpoint)
    if any(n.endswith(SCALE_SUFFIX) for n in names):
        fp8.weights.extend(w for w in linears if scale_name(w) in names)
    else:
        fp8.weights.extend(w for w in linears if not _skipped(w.removesuffix(".weight"), quant))
    if not fp8.weights:
        raise InvalidArgument("the FP8 quantization config leaves no linear weight quantized "
                              "(modules_to_not_convert / ignored_layers cover them all)")
    return pb.WeightFormat(fp8=fp8)


def describe(fmt: pb.WeightFormat | None) -> str:
    if fmt is None or not fmt.HasField("fp8"):
        return "unquantized"
    f = fmt.fp8
    return (f"fp8 {f.fmt} blocks {list(f.block)}, {f.scale_dtype} scales{' (powers of two)' if f.pow2_scales else ''}, "
            f"{len(f.weights)} weights")


def same_format(a: pb.WeightFormat | None, b: pb.WeightFormat | None) -> bool:
    """Whether the weights are quantized alike (stacked experts are a way of sending them, not a format)."""
    a = a.fp8 if a is not None and a.HasField("fp8") else None
    b = b.fp8 if b is not None and b.HasField("fp8") else None
    if a is None or b is None:
        return a is None and b is None
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def stacked(fmt: pb.WeightFormat | None) -> bool:
    """Whether fused experts parameters go out stacked to replicas of `fmt` (never with fp8's per-expert list)."""
    return fmt is not None and fmt.stacked_experts and not fmt.HasField("fp8")
