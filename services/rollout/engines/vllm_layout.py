"""Which box of each checkpoint tensor a vLLM worker loads, found by vLLM's own weight loaders, and
staging that holds only those boxes yet hands the loaders full-shape tensors.

`probe_loads` runs the model's `load_weights` once on probes (each element's value is its unique id)
into float64 shadow parameters swapped in for the live ones (which are put back untouched), and reads
back which elements each rank's loaders kept: column and row parallel linears, merged qkv and gate_up,
key/value heads replicated over ranks, padded vocabularies, for every model vLLM loads, with no table
per architecture. The shadows copy the parameters as vLLM recorded them before processing them (its
layerwise reload metadata: on the CPU build linear weights are prepacked afterwards).

`BoxStaging` packs the boxes in one buffer per dtype and gives the loader each tensor as a full-shape
strided view whose in-box elements are the staged box (out-of-box elements alias neighbouring boxes;
the loaders never read them: that is what the probe established). Slices are ordered so neighbours
cover each other's out-of-box range, so the buffer is the boxes and little more.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from rlsync.checkpoint_names import Unstacked
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import Box, row_major_strides

if TYPE_CHECKING:
    from rlsync.rollout.engines.vllm_experts import Placement


def original_loader(fn):
    while getattr(fn, "__name__", "") == "online_process_loader":  # vLLM's layerwise-reload wrapper
        fn = fn.__wrapped__
    return fn


def shadow_param(template: torch.Tensor, module: torch.nn.Module, device: str = "meta") -> torch.Tensor:
    """A tensor like `template` (its class and attributes, its original weight_loader bound to `module`): on
    the meta device (no memory, no data), or zeros on `device`, for vLLM's loaders to load into."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    t = torch.empty(tuple(template.shape), dtype=template.dtype, device="meta") if device == "meta" else \
        torch.zeros(tuple(template.shape), dtype=template.dtype, device=device)
    t.__class__ = template.__class__
    t.__dict__ = template.__dict__.copy()
    restore_layer_refs(t, module)
    t.weight_loader = original_loader(getattr(t, "weight_loader", default_weight_loader))
    return t


def recording_shadow(template: torch.Tensor, module: torch.nn.Module, record) -> torch.Tensor:
    """A float64 meta tensor with the template's class and attributes (its weight_loader bound to
    `module`), whose loader runs the original one on a real scratch copy and records what landed
    (`record(scratch)`)."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    t = torch.empty(tuple(template.shape), dtype=torch.float64, device="meta")
    t.__class__ = template.__class__
    t.__dict__ = template.__dict__.copy()
    restore_layer_refs(t, module)
    original = original_loader(getattr(t, "weight_loader", default_weight_loader))

    def recording_loader(param, loaded_weight, *args, **kwargs):
        scratch = torch.zeros(tuple(param.shape), dtype=torch.float64)
        scratch.__class__ = param.__class__
        scratch.__dict__ = param.__dict__.copy()
        scratch.weight_loader = original
        result = original(scratch, loaded_weight, *args, **kwargs)
        record(scratch)
        return result

    t.weight_loader = recording_loader
    return t


@contextlib.contextmanager
def shadowed(model: torch.nn.Module, make) -> Iterator[dict[int, tuple[torch.nn.Module, str]]]:
    """Swaps a shadow, `make(template, module, name)`, in for every parameter of `model` (and for those
    vLLM recorded before processing them: its layerwise reload metadata), under no_grad, and puts the live
    ones back untouched on exit. A tied parameter gets one shadow for all its owners. Yields
    {id(shadow): (module, name)}."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    saved, shadows, owners = [], {}, {}
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        recorded = info.restore_metadata[0] if info is not None else {}
        live = {k: v for k, v in module._parameters.items() if v is not None}
        if not live and not recorded:
            continue
        saved.append((module, dict(module._parameters)))
        for name in [*live, *(k for k in recorded if k not in live)]:
            param = live.get(name)
            if param is not None and id(param) in shadows:  # tied: one shadow for both owners
                module._parameters[name] = shadows[id(param)]
                continue
            module._parameters[name] = shadow = make(recorded.get(name, param), module, name)
            owners[id(shadow)] = (module, name)
            if param is not None:
                shadows[id(param)] = shadow
    try:
        with torch.no_grad():
            yield owners
    finally:
        for module, params in saved:
            module._parameters.clear()
            module._parameters.update(params)


class Loads(NamedTuple):
    """What this rank's loaders do with a checkpoint's tensors (probe_loads)."""

    boxes: list[Box | None]  # per tensor, the box this rank loads, or None
    # the names of the tensors that load into `layers` (and nowhere else), when they fill every element of those
    # layers' parameters; else None
    into_layers: frozenset[str] | None


def probe_loads(model: torch.nn.Module, specs: Sequence[Spec], layers: Collection[torch.nn.Module] = ()) -> Loads:
    """Per tensor of `specs` (the checkpoint's), the box this rank loads (the bounding box when its
    loaders keep an irregular set, as for a pre-merged qkv), or None when it loads nothing of it; and which
    tensors load into `layers` (vllm_experts: expert layers a replica loads without vLLM's reload path)."""
    numels = [math.prod(s.shape) for s in specs]
    bases = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    if bases[-1] >= 2 ** 53:
        raise ValueError("the checkpoint has too many elements for float64 probe ids")
    low = [None] * len(specs)
    high = [None] * len(specs)
    into = [set() for _ in specs]  # per tensor, whether it landed in `layers` (True) or elsewhere (False)
    ids_of = {id(layer) for layer in layers}
    filled: dict[tuple[int, str], int] = {}  # per parameter of `layers`, how many elements were loaded

    def record(scratch: torch.Tensor, module: torch.nn.Module, name: str) -> None:
        values = scratch.detach().reshape(-1)
        if id(module) in ids_of:
            filled[(id(module), name)] = filled.get((id(module), name), 0) + int((values != 0).sum())
        ids = values[values != 0].to(torch.int64).numpy() - 1
        which = np.searchsorted(bases, ids, side="right") - 1
        for t in np.unique(which):
            into[t].add(id(module) in ids_of)
            flat = ids[which == t] - bases[t]
            coords = np.stack(np.unravel_index(flat, specs[t].shape), 1) if specs[t].shape else \
                np.zeros((len(flat), 0), np.int64)
            lo, hi = coords.min(0), coords.max(0) + 1
            low[t] = lo if low[t] is None else np.minimum(low[t], lo)
            high[t] = hi if high[t] is None else np.maximum(high[t], hi)

    def probes() -> Iterator[tuple[str, torch.Tensor]]:
        for i, s in enumerate(specs):
            yield s.name, (torch.arange(numels[i], dtype=torch.float64) + float(bases[i] + 1)).reshape(s.shape)

    expected: dict[tuple[int, str], int] = {}  # the parameters of `layers`: their elements

    def make(template, module, name):
        if id(module) in ids_of:
            expected[(id(module), name)] = template.numel()
        return recording_shadow(template, module, functools.partial(record, module=module, name=name))

    with shadowed(model, make):
        model.load_weights(probes())
    boxes = [None if lo is None else tuple((int(a), int(b)) for a, b in zip(lo, hi)) for lo, hi in zip(low, high)]
    whole = all(filled.get(key) == n for key, n in expected.items()) and all(len(i) < 2 for i in into)
    names = frozenset(s.name for s, i in zip(specs, into) if i == {True})
    return Loads(boxes, names if expected and whole else None)


class BoxStaging:
    """This rank's boxes of the tensors of `specs`, packed per dtype (see the module's doc). How they pack is the
    same at every update of the same tensors and boxes: laid out once (_packing), a buffer allocated each time.
    `placed` (vllm_experts.placement): the expert layers' tensors are laid out in blocks, the parameters as vLLM's
    loaders would have filled them (`blocks`); the transfer loads them, and they are not handed to the loaders
    (`full`). A rlsync.flat.Store: its views stay where they are, so a worker keeps it to receive the next update
    of the same tensors and boxes into (`fits`), and what the receiver laid out over it is kept in its `memo`.
    `stack`: the stacked experts among `specs` (checkpoint_names.stacked_specs), whose box is staged as one and
    handed to the loaders as its experts' tensors, each full-shape as above."""

    def __init__(self, specs: Sequence[Spec], boxes: Sequence[Box | None], device: torch.device,
                 placed: Placement | None = None, stack: Unstacked | None = None):
        # (shared by every staging of these tensors and boxes: read, never changed)
        self.layout = _packing(tuple(specs), tuple(boxes), placed, _stacked_names(stack))
        self.specs, self.boxes, self.place, sizes, (self._blocks, self.in_blocks) = self.layout
        self.device = device
        self.stack = stack
        self._made_of = (specs, boxes, placed, stack)  # (the same objects again at the next update: fits at once)
        self.buffers = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self.views = self._views()  # (each tensor's box, contiguous: where the transfer lands it)
        self.memo: dict = {}

    def fits(self, specs: Sequence[Spec], boxes: Sequence[Box | None], device: torch.device,
             placed: Placement | None = None, stack: Unstacked | None = None) -> bool:
        """Whether it is laid out as a new BoxStaging of these would be."""
        made = self._made_of
        if made[0] is specs and made[1] is boxes and made[2] is placed and made[3] is stack:  # (a worker's cached)
            return self.device == device
        if self.device != device or self.layout is not _packing(tuple(specs), tuple(boxes), placed,
                                                                 _stacked_names(stack)):
            return False
        self.stack = stack  # (the same tensors: their experts' names alike)
        return True

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def views_for(self, specs) -> dict[str, torch.Tensor]:
        """Its views (staged under the manifest's names already)."""
        return self.views

    @staticmethod
    def nbytes_of(specs: Sequence[Spec], boxes: Sequence[Box | None], placed: Placement | None = None,
                  stack: Unstacked | None = None) -> int:
        """The bytes a BoxStaging of these takes, before it is allocated."""
        sizes = _packing(tuple(specs), tuple(boxes), placed, _stacked_names(stack))[3]
        return sum(n * dtype.itemsize for dtype, n in sizes.items())

    def _views(self) -> dict[str, torch.Tensor]:
        out = {}
        for s in self.specs:
            dtype, offset, strides = self.place[s.name]
            extent = [b - a for a, b in self.boxes[s.name]]
            out[s.name] = self.buffers[dtype].as_strided(extent, strides, offset)
        return out

    def full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, a full-shape view whose box holds the staged values), for the loaders: the tensors not in blocks
        (a stacked tensor's experts, each its own, of those in its box)."""
        members = {self.stack.specs[i].name: r for i, r in self.stack.members.items()} if self.stack else {}
        for s in self.specs:
            if s.name in self.in_blocks:
                continue
            dtype, offset, strides = self.place[s.name]
            box, names = self.boxes[s.name], members.get(s.name)
            if names is None:
                before = sum(a * st for (a, _), st in zip(box, strides))
                yield s.name, self.buffers[dtype].as_strided(s.shape, strides, offset - before)
                continue
            (e0, e1), (k0, k1) = box[:2]
            inner = math.prod(b - a for a, b in box[2:])
            before = sum(a * st for (a, _), st in zip(box[2:], strides[2:]))
            for e, k in itertools.product(range(e0, e1), range(k0, k1)):
                at = offset + ((e - e0) * (k1 - k0) + k - k0) * inner - before
                yield (self.stack.flat[names[e * s.shape[1] + k]].name,
                       self.buffers[dtype].as_strided(s.shape[2:], strides[2:], at))

    def blocks(self) -> dict:
        """The blocks the expert layers' tensors were laid out in, by parameter (vllm_experts.Param): {} without."""
        return {key: self.buffers[dtype][offset:offset + math.prod(shape)].view(shape)
                for key, shape, dtype, offset in self._blocks}


def _stacked_names(stack: Unstacked | None) -> frozenset[str]:
    return frozenset(stack.specs[i].name for i in stack.members) if stack is not None else frozenset()


@functools.lru_cache(maxsize=4)
def _packing(specs: tuple[Spec, ...], boxes: tuple[Box | None, ...], placed: Placement | None,
             stacked: frozenset[str] = frozenset()):
    """BoxStaging's layout of these boxes: the tensors it holds, their boxes by name, where each lies (name ->
    dtype, offset, box strides), each dtype's buffer's elements, and the blocks (parameter, shape, dtype, offset)
    with the names of the tensors laid out in them. A `stacked` tensor's full views are its experts' ([e, k])."""
    in_blocks = frozenset(name for name, _, _ in placed.at) if placed is not None else frozenset()
    held = [s for s, b in zip(specs, boxes) if b is not None]
    by_name = {s.name: b for s, b in zip(specs, boxes) if b is not None}
    place: dict[str, tuple[torch.dtype, int, list[int]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for dtype in dict.fromkeys(s.dtype for s in held if s.name not in in_blocks):
        items = []
        for s in (s for s in held if s.dtype == dtype and s.name not in in_blocks):
            box = by_name[s.name]
            extent = [b - a for a, b in box]
            strides = row_major_strides(extent)
            lead = 2 if s.name in stacked else 0  # (a stacked one's full views: each expert's, from its own place)
            before = sum(a * st for (a, _), st in zip(box[lead:], strides[lead:]))  # what a full view reaches back
            reach = sum((d - 1) * st for d, st in zip(s.shape[lead:], strides[lead:])) + 1 if s.shape else 1
            reach += math.prod(extent) - math.prod(extent[lead:])  # (the last expert's starts that much later)
            items.append((s.name, strides, before, reach, math.prod(extent)))
        items.sort(key=lambda it: it[2] - (it[3] - it[2] - it[4]))  # room before late, room after early
        start = filled = 0
        for _, _, before, _, numel in items:
            start = max(start, before - filled)
            filled += numel
        offset = end = start
        for name, strides, before, reach, numel in items:
            place[name] = (dtype, offset, strides)
            end = max(end, offset - before + reach, offset + numel)
            offset += numel
        sizes[dtype] = max(end, offset)
    blocks = []
    for key, shape, dtype in placed.blocks if placed is not None else ():  # after the loose tensors of their dtype
        blocks.append((key, shape, dtype, sizes.get(dtype, 0)))
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    for name, block, start in placed.at if placed is not None else ():
        _, _, dtype, offset = blocks[block]
        place[name] = (dtype, offset + start, row_major_strides([b - a for a, b in by_name[name]]))
    return held, by_name, place, sizes, (tuple(blocks), in_blocks)
