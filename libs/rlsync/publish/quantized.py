"""Quantization as a stage of the update: any source, its weights quantized on the way out in the format
the replicas hold (rlsync.quant.fp8_format), each "<module>.weight" followed by its
"<module>.weight_scale_inv". A single-process source makes one pass per transfer as any streamed source;
on a GPU one kernel per weight (rlsync.quant.fp8_kernel), elsewhere the reference (rlsync.quant.fp8_blocks):
the same bits. A sharded model's ranks each quantize the boxes they hold (QuantizedShards), the same bits."""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument
from rlsync.publish.quantized_shards import SCALE, WEIGHT, QuantizedShards
from rlsync.publish.source import ShardedModule
from rlsync.quant.fp8_blocks import FP8, scale_shape
from rlsync.quant.fp8_format import scale_name
from rlsync.quant.fp8_kernel import quantize
from rlsync.transfer.manifest import Spec
from rlsync.transfer.source import ResidentSource, StreamedSource
from rlsync.transfer.v1 import transfer_pb2 as pb


def stage(base: list[Spec], fmt: pb.WeightFormat) -> tuple[list[Spec], list[tuple[int, int]]]:
    """The tensors the stage sends for a source of `base`: every listed weight as FP8 then its scales,
    every other tensor as it was; and plan[j] = (index in `base`, WEIGHT | SCALE | 0) of each."""
    f = fmt.fp8
    block = tuple(f.block)
    by_name = {s.name: i for i, s in enumerate(base)}
    missing = [w for w in f.weights if w not in by_name]
    if missing:
        raise InvalidArgument(f"the replicas hold {len(missing)} weight(s) in FP8 that this trainer does not publish: "
                              f"{missing[:3]}{' ...' if len(missing) > 3 else ''} (check the names it publishes)")
    wanted = set(f.weights)
    specs, plan = [], []
    for i, s in enumerate(base):
        if s.name not in wanted:
            specs.append(Spec(s.name, s.dtype, s.shape, s.nbytes))
            plan.append((i, 0))
            continue
        if len(s.shape) != 2 or not s.dtype.is_floating_point:
            raise InvalidArgument(f"{s.name!r} is {s.dtype}{list(s.shape)}: only 2-D floating-point weights are "
                                  "quantized to block FP8")
        grid = scale_shape(s.shape, block)
        specs += [Spec(s.name, FP8, s.shape, s.shape[0] * s.shape[1]), Spec(scale_name(s.name), torch.float32, grid,
                                                                             4 * grid[0] * grid[1])]
        plan += [(i, WEIGHT), (i, SCALE)]
    return specs, plan


def quantized(source: ResidentSource | StreamedSource | ShardedModule, fmt: pb.WeightFormat
              ) -> StreamedSource | ShardedModule:
    """`source` with the weights `fmt` lists in FP8 plus their scales; every other tensor as it was."""
    if getattr(source, "adapter", None) is not None:
        raise InvalidArgument("a LoRA adapter is not quantized: its replicas apply it to their base in the engine's "
                              "dtype (publish the adapter to replicas that hold an unquantized model)")
    if isinstance(source, ShardedModule):  # every rank quantizes what it holds
        specs, plan = stage(source.specs, fmt)
        out = ShardedModule(QuantizedShards(source.shards, specs, plan, fmt, source.device), specs, source.device)
    else:
        specs, plan = stage(source.specs(), fmt)
        out = StreamedSource(specs, source.device, _produce(source, plan, fmt), frozen=source.frozen)
    out.format = fmt
    out.quantized = frozenset(s.name for s, (_, part) in zip(specs, plan) if part)  # audited as sent, never cast
    return out


def _produce(source: ResidentSource | StreamedSource, plan: list[tuple[int, int]], fmt: pb.WeightFormat):
    """The stage's tensor j of a single-process source: its weight's scales are made with its values."""
    block, pow2 = tuple(fmt.fp8.block), fmt.fp8.pow2_scales
    if isinstance(source, ResidentSource):
        tensors = list(source.tensors.values())
        read = tensors.__getitem__
    else:  # produced in order as before: this stage asks each base tensor once, in order
        read = _in_order(source)
    last: dict[int, torch.Tensor] = {}  # base index -> its scales, made with its values

    @torch.no_grad()
    def produce(j: int) -> torch.Tensor:
        i, part = plan[j]
        if part == SCALE:
            return last.pop(i)
        t = read(i).detach()
        if part == 0:
            return t
        last.clear()
        q, s = quantize(t, block, pow2)
        last[i] = s
        return q

    return produce


def _in_order(source: StreamedSource):
    """Reads a streamed source's tensors by index, in order, one pass per pass of the stage over it."""
    state = {"pass": None, "at": -1}

    def read(i: int) -> torch.Tensor:
        if state["pass"] is None or i <= state["at"]:
            if state["pass"] is not None:
                state["pass"].finish()
            state["pass"] = source.stream()
        state["at"] = i
        state["pass"][i]
        return state["pass"].tensor

    return read
