"""Quantization as a stage of the update: any source, its weights quantized on the way out in the format
the replicas hold (rlsync.quant.fp8_format), each "<module>.weight" followed by its
"<module>.weight_scale_inv". Resident weights (rlsync's trainer, a user's plain module) are quantized into a
buffer of their own on the trainer's device (QuantizedBuffer), filled again at every offer, on a GPU in one
launch for all of them (fp8_kernel.ManyQuantizer): what is sent is then resident too, so replicas on the GPU
pull it (or keep it mapped) as any resident weights, and delta updates diff its FP8 bytes. Streamed ones
(cast, or gathered by every rank in step) are quantized as they are sent, one kernel per weight. Elsewhere
than on a GPU the reference (rlsync.quant.fp8_blocks): the same bits. A sharded model's ranks each quantize
the boxes they hold (QuantizedShards; on a GPU in a launch or two for all of them: fp8_box_kernel), the
same bits."""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument
from rlsync.flat import FlatStore
from rlsync.publish.quantized_shards import SCALE, WEIGHT, QuantizedShards
from rlsync.publish.source import ShardedModule
from rlsync.quant.fp8_blocks import FP8, scale_shape
from rlsync.quant.fp8_format import scale_name
from rlsync.quant.fp8_kernel import ManyQuantizer, quantize
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
              ) -> QuantizedBuffer | ShardedModule:
    """`source` with the weights `fmt` lists in FP8 plus their scales; every other tensor as it was."""
    if getattr(source, "adapter", None) is not None:
        raise InvalidArgument("a LoRA adapter is not quantized: its replicas apply it to their base in the engine's "
                              "dtype (publish the adapter to replicas that hold an unquantized model)")
    if isinstance(source, ResidentSource):
        return QuantizedBuffer(source, fmt)
    if isinstance(source, ShardedModule):  # every rank quantizes what it holds
        specs, plan = stage(source.specs, fmt)
        out = ShardedModule(QuantizedShards(source.shards, specs, plan, fmt, source.device), specs, source.device)
    else:  # produced tensor by tensor (cast, or gathered by every rank in step): quantized as they come
        specs, plan = stage(source.specs(), fmt)
        out = StreamedSource(specs, source.device, _produce(source, plan, fmt), frozen=source.frozen)
    out.format = fmt
    out.quantized = frozenset(s.name for s, (_, part) in zip(specs, plan) if part)  # audited as sent, never cast
    return out


class QuantizedBuffer(ResidentSource):
    """A single-process source's tensors as the replicas hold them: the listed weights' FP8 values and scales
    in one flat store on its device (a buffer per dtype), every other tensor the source's own (embeddings,
    norms, lm_head: sent from where they lie, as without a format; nothing copies them). `refresh()`
    quantizes the source's values now into the buffer; the publisher calls it at every offer, so the FP8
    bytes sent, audited and diffed are what was quantized then. Like the source's own tensors, the buffer's
    memory never moves: a replica that holds it mapped maps nothing again. It costs the quantized weights'
    bytes on the device (about half of their bf16), from the first offer to the offload (which drops the
    sender, and this with it)."""

    def __init__(self, base: ResidentSource, fmt: pb.WeightFormat):
        specs, plan = stage(base.specs(), fmt)
        self.store = FlatStore({s.name: (s.shape, s.dtype) for s, (_, part) in zip(specs, plan) if part},
                               base.device)
        tensors = [t.detach() for t in base.tensors.values()]
        views = {s.name: self.store.views[s.name] if part else tensors[i] for s, (i, part) in zip(specs, plan)}
        super().__init__(views, frozen=base.frozen)
        self.base = base  # (kept alive: the quantizer's table holds where its tensors lie)
        self.format = fmt
        self.quantized = frozenset(s.name for s, (_, part) in zip(specs, plan) if part)  # audited as sent
        out = list(views.values())
        # (a resident source's tensors stay where they are: what reads them is laid out once)
        self._quantizer = ManyQuantizer([(tensors[i], out[j], out[j + 1]) for j, (i, part) in enumerate(plan)
                                         if part == WEIGHT], tuple(fmt.fp8.block), fmt.fp8.pow2_scales)
        self.refresh()  # (whole before anything reads it)

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantizes the source's current values into the buffer; returns once they are there."""
        self._quantizer.run()
        if self.device.type == "cuda":  # whole before anything reads it, on any stream
            torch.cuda.current_stream(self.device).synchronize()


def _produce(source: StreamedSource, plan: list[tuple[int, int]], fmt: pb.WeightFormat):
    """The stage's tensor j of a streamed source: its weight's scales are made with its values (the base's
    tensors asked once each, in order)."""
    block, pow2 = tuple(fmt.fp8.block), fmt.fp8.pow2_scales
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
