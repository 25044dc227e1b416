"""Fused-expert layers reloaded so that a refit computes what it verifies, at a cost close to a dense layer's.

vLLM 0.32's unquantized MoE method (`UnquantizedFusedMoEMethod._setup_kernel`) takes any processing after a
kernel was built for a weight update, and then skips its experts' own processing of the layer
(`fused_experts.process_weights_after_loading`). On the CPU build that processing is what pads the
intermediate size to the kernel's alignment and prepacks w13 / w2 into `cpu_fused_moe`'s grouped-gemm layout:
a reload hands the kernel plain row-major experts it reads as packed (wrong tokens, though every byte it was
given is right), and where the padding changes a shape (TP = 2 of the tiny MoE: 16 -> 32 rows) the layerwise
copy-back fails on a size mismatch.

`reload` makes an update live through vLLM's reload with the built kernels forgotten first (`first_load_processing`:
vLLM's own first-load path, pad, prepack, a kernel built anew over the same weights), and `live_mismatches` reads
back what the engine computes with against `processed` of the same tensors, bit for bit: `processed` loads the
tensors handed for the expert layers by vLLM's own loaders into scratch copies of their parameters as first loaded
and has the layers' experts process them (pad, prepack). Once that read-back found them equal for a list of
tensors that fill the expert layers (vllm_layout.probe_loads says which), `processed` is vLLM's own processing on
this backend, and the next updates of those tensors load the experts apart: vLLM's reload takes `processed`'s
result in kernel format, copied into the parameters the engine runs with, and every other tensor goes through its
reload path (without its bookkeeping per expert: a commit in half the time). The scratch copies are then filled by
the copies of boxes vLLM's loaders amount to (`apart_copies`: learnt on id probes right after the read-back, kept
only where they make exactly the live experts), in one launch instead of a loader call per expert and shard; or,
where those copies are whole staged boxes that tile the parameters (`placement`), the worker's staging lays the
experts out in blocks shaped as the parameters, each box where its copy puts it, and the transfer itself loads them
(`processed_blocks`: no loader call, no copy).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from rlsync.checkpoint_names import Unstacked
from rlsync.rollout.engines.vllm_layout import recording_shadow, shadow_param, shadowed
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import Box, row_major_strides


def _processes_layer(method) -> bool:
    """Whether `method`'s built kernel has experts that process the layer themselves (a no-op by default)."""
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return False
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    own = getattr(type(experts), "process_weights_after_loading", None)
    return own is not None and own is not FusedMoEExperts.process_weights_after_loading


def expert_methods(model: torch.nn.Module) -> list:
    """The MoE quant methods of `model` whose experts' processing a plain reload would skip."""
    methods = {id(m): m for m in (getattr(mod, "quant_method", None) for mod in model.modules())
               if m is not None and _processes_layer(m)}
    return list(methods.values())


@contextlib.contextmanager
def first_load_processing(model: torch.nn.Module) -> Iterator[int]:
    """Within it, vLLM processes the expert layers a reload loads as at its first load; yields how many
    layers' kernels it forgot. A layer the reload did not process (none of its tensors were sent, or the
    reload raised) gets its kernel back: its parameters are as they were."""
    methods = expert_methods(model)
    kernels = [m.moe_kernel for m in methods]
    for m in methods:
        m.moe_kernel = None
    try:
        yield len(methods)
    finally:
        for m, kernel in zip(methods, kernels):
            if m.moe_kernel is None:
                m.moe_kernel = kernel


def expert_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `model` whose experts process their parameters (pad, prepack) after loading."""
    return list({id(mod): mod for mod in model.modules()
                 if (m := getattr(mod, "quant_method", None)) is not None and _processes_layer(m)}.values())


Param = tuple[int, str]  # an expert layer's parameter: (id of the layer, the parameter's name)


class Copies(NamedTuple):
    """What vLLM's loaders do with the expert layers' tensors, as copies (learn_copies)."""

    # per parameter, in the loaders' order: (tensor, a box of the parameter, a box of the tensor)
    boxes: dict[Param, list[tuple[str, tuple[slice, ...], tuple[slice, ...]]]]
    params: dict[Param, tuple[tuple[int, ...], torch.dtype]]  # per parameter, its shape and dtype as first loaded


class Placement(NamedTuple):
    """Where a staging lays the expert layers' tensors out so that the transfer loads them (placement): blocks shaped
    as the parameters as first loaded, each tensor's staged box the run of its block vLLM's loaders copy it to."""

    blocks: tuple[tuple[Param, tuple[int, ...], torch.dtype], ...]  # per parameter: which, its shape and dtype
    at: tuple[tuple[str, int, int], ...]  # per tensor: its name, its block, where its run starts there (elements)


def processed(model: torch.nn.Module, handed: Iterable[tuple[str, torch.Tensor]],
              copies: Copies | None = None) -> dict[str, torch.Tensor]:
    """The parameters of the expert layers as vLLM makes them of the tensors `handed`, by live name
    (`module.param`): loaded into scratch copies of the parameters as first loaded, then processed by the layer's
    experts (pad, prepack). The kernel format vLLM's reload takes as it is. Loaded by vLLM's own loaders, or by the
    `copies` they amount to (learn_copies: one launch, no loader call per expert and shard)."""
    layers = {id(mod) for mod in expert_layers(model)}
    if not layers:
        return {}
    scratch: dict[Param, torch.Tensor] = {}

    def make(template, module, name):
        if id(module) not in layers:
            return shadow_param(template, module)  # (the other layers' loaders write nothing real)
        t = shadow_param(template, module, device=str(module._parameters[name].device)
                         if module._parameters.get(name) is not None else "cpu")
        scratch[(id(module), name)] = t
        return t

    with shadowed(model, make):
        if copies is None:
            model.load_weights(iter(handed))
    if copies is not None:
        tensors, into, values = dict(handed), [], []
        for key, boxes in copies.boxes.items():
            for name, into_box, from_box in boxes:
                into.append(scratch[key][into_box])
                values.append(tensors[name][from_box].reshape(into[-1].shape))
        if into:
            torch._foreach_copy_(into, values)
    return processed_blocks(model, scratch)


def processed_blocks(model: torch.nn.Module, blocks: Mapping[Param, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The expert layers' parameters as their experts process (pad, prepack) `blocks`, the parameters as first
    loaded (processed's scratch, or a staging's blocks that the transfer loaded: placement), by live name. The
    blocks are read, not changed."""
    layers = {id(mod): mod for mod in expert_layers(model)}
    names = {id(mod): name for name, mod in model.named_modules() if id(mod) in layers}
    standins: dict[int, torch.nn.Module] = {}
    for (key, name), t in blocks.items():
        if (standin := standins.get(key)) is None:
            layer = layers[key]
            standin = standins[key] = torch.nn.Module()
            for attr in ("moe_config", "activation"):  # (what the experts read of a layer to choose their kernel)
                if hasattr(layer, attr):
                    setattr(standin, attr, getattr(layer, attr))
        standin.register_parameter(name, torch.nn.Parameter(t.data, requires_grad=False))
    out = {}
    for key, standin in standins.items():
        experts = copy.copy(layers[key].quant_method.moe_kernel.fused_experts)  # (its own state stays the live one's)
        experts.process_weights_after_loading(standin)
        out.update((f"{names[key]}.{name}", want.data) for name, want in standin.named_parameters())
    return out


def placement(copies: Copies, specs: Sequence[Spec], boxes: Sequence[Box | None]) -> Placement | None:
    """Where a staging of `boxes` of the tensors `specs` (vllm_layout.Loads') may lay the expert layers' tensors out
    so that the transfer loads them: each tensor's box at the place vLLM's loaders copy it to (`copies`), in blocks
    shaped as the parameters as first loaded -> None unless every copy is a whole staged box (of the parameter's
    dtype) into a run of a parameter, each tensor copied once, and the runs tile every parameter (nothing else is
    in a block)."""
    staged = {s.name: (b, s.dtype) for s, b in zip(specs, boxes) if b is not None}
    blocks, at, runs, seen = [], [], [], set()
    for i, (key, (shape, dtype)) in enumerate(copies.params.items()):
        blocks.append((key, tuple(shape), dtype))
        for name, into_box, from_box in copies.boxes.get(key, ()):
            box, of = staged.get(name, (None, None))
            start = _run_start(into_box, shape)
            if name in seen or box is None or of != dtype or tuple((s.start, s.stop) for s in from_box) != box \
                    or start is None or math.prod(b - a for a, b in box) != _numel(into_box):
                return None
            seen.add(name)
            at.append((name, i, start))
            runs.append((i, start, start + _numel(into_box)))
    runs.sort()
    for i, (_, shape, _) in enumerate(blocks):  # the runs of each block, in order, end to end from 0 to its end
        ends = [(a, b) for j, a, b in runs if j == i]
        if not ends or [a for a, _ in ends] != [0, *(b for _, b in ends[:-1])] or ends[-1][1] != math.prod(shape):
            return None
    return Placement(tuple(blocks), tuple(at))


def stacked_placement(stack: Unstacked, placed: Placement | None, boxes: Sequence[Box | None],
                      flat_boxes: Sequence[Box | None]) -> Placement | None:
    """`placed` (placement of `stack.flat`'s tensors, whose boxes are `flat_boxes`) for the manifest's tensors, whose
    boxes are `boxes`: a stacked one's box lies in one block, where its first expert's does, when every expert in it
    has that box of its own and they lie there one after another in its order (as its box stages them: [e, k]
    row-major); else None."""
    if placed is None or not stack.members:
        return placed
    at = {name: (block, start) for name, block, start in placed.at}
    out = []
    for i, s in enumerate(stack.specs):
        members, box = stack.members.get(i), boxes[i]
        if members is None:
            if s.name in at:
                out.append((s.name, *at[s.name]))
            continue
        if box is None:
            continue
        (e0, e1), (k0, k1) = box[:2]
        inner = math.prod(b - a for a, b in box[2:])
        held = [members[e * s.shape[1] + k] for e, k in itertools.product(range(e0, e1), range(k0, k1))]
        runs = [at.get(stack.flat[j].name) for j in held]
        if any(flat_boxes[j] != box[2:] for j in held) or \
                any(r is None or r != (runs[0][0], runs[0][1] + m * inner) for m, r in enumerate(runs)):
            return None
        out.append((s.name, *runs[0]))
    return Placement(placed.blocks, tuple(out))


def _numel(box: tuple[slice, ...]) -> int:
    return math.prod(b.stop - b.start for b in box)


def _run_start(box: tuple[slice, ...], shape: tuple[int, ...]) -> int | None:
    """The row-major offset where `box` of a tensor of `shape` starts, when its elements are one run there; else
    None."""
    if len(box) != len(shape):
        return None
    extents = [b.stop - b.start for b in box]
    wide = next((d for d, n in enumerate(extents) if n > 1), len(extents))  # (those before: one element wide)
    if any(extents[d] != shape[d] for d in range(wide + 1, len(shape))):
        return None
    strides = row_major_strides(shape)
    return sum(b.start * st for b, st in zip(box, strides))


def learn_copies(model: torch.nn.Module, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> Copies | None:
    """What vLLM's loaders do with tensors of these names and shapes in the expert layers, as copies: per parameter,
    (tensor, a box of the parameter, a box of the tensor) in the loaders' order, found by running them once on probes
    (each element's value its id, vllm_layout.recording_shadow). None where one loader call does more than copy a
    box of one tensor into a box of the parameter, element for element in row-major order (the copies could not
    stand for it)."""
    layers = {id(mod) for mod in expert_layers(model)}
    numels = [math.prod(shape) for _, shape in shapes]
    bases = np.concatenate([[0], np.cumsum(numels)]).astype(np.int64)
    found = Copies({}, {})
    plain = [True]

    def record(scratch: torch.Tensor, module: torch.nn.Module, name: str) -> None:
        if id(module) not in layers:
            return
        values = scratch.detach().reshape(-1)
        where = torch.nonzero(values).reshape(-1).numpy()  # (row-major)
        ids = values[where].to(torch.int64).numpy() - 1
        if not len(ids):
            return
        t = int(np.searchsorted(bases, ids[0], side="right") - 1)
        if not 0 <= t < len(shapes):  # (a value no probe holds: the loader computed it)
            plain[0] = False
            return
        offsets = ids - bases[t]
        into, source = _box_of(where, tuple(scratch.shape)), _box_of(offsets, shapes[t][1])
        if into is None or source is None:
            plain[0] = False
            return
        found.boxes.setdefault((id(module), name), []).append((shapes[t][0], into, source))

    def make(template, module, name):
        if id(module) in layers:
            found.params[(id(module), name)] = (tuple(template.shape), template.dtype)
        return recording_shadow(template, module, functools.partial(record, module=module, name=name))

    def probes() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, shape) in enumerate(shapes):
            yield name, (torch.arange(numels[i], dtype=torch.float64) + float(bases[i] + 1)).reshape(shape)

    with shadowed(model, make):
        model.load_weights(probes())
    return found if plain[0] else None


def _box_of(offsets: np.ndarray, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The box of a tensor of `shape` whose elements' row-major offsets are exactly `offsets`, in that order; None
    where they are not one."""
    if not shape:
        return () if np.array_equal(offsets, [0]) else None
    if (offsets < 0).any() or (offsets >= math.prod(shape)).any():
        return None
    coords = np.unravel_index(offsets, shape)
    box = tuple(slice(int(c.min()), int(c.max()) + 1) for c in coords)
    strides = row_major_strides(shape)
    expect = np.zeros((), dtype=np.int64)
    for b, stride in zip(box, strides):
        expect = expect[..., None] + np.arange(b.start, b.stop, dtype=np.int64) * stride
    return box if np.array_equal(expect.reshape(-1), offsets) else None


def live_mismatches(model: torch.nn.Module, handed: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The live parameters of expert layers (`module.param`) that differ from what their experts' processing makes
    of the tensors `handed` to the reload; [] when every one is equal (or no layer's experts process it)."""
    wrong = []
    for name, want in processed(model, handed).items():
        module, _, param = name.rpartition(".")
        live = model.get_submodule(module)._parameters.get(param)
        if live is None or live.shape != want.shape or not torch.equal(live.data, want.data):
            wrong.append(name)
    return wrong


def reload(reload_weights: Callable[..., None], model: torch.nn.Module,
           handed: Callable[[], Iterable[tuple[str, torch.Tensor]]], experts: frozenset[str] | None,
           apart: bool, copies: Copies | None = None, blocks: Mapping[Param, torch.Tensor] | None = None) -> list[str]:
    """Makes the tensors `handed()` gives live through vLLM's reload (`reload_weights`, a worker's) -> the live
    expert parameters that differ from vLLM's processing of what was handed ([]: none).

    experts: the names of the tensors that load into expert layers and fill them (vllm_layout.probe_loads).
    `apart` (once a commit of the same tensors found `processed` of them equal to vLLM's own processing, below): the
    other tensors go through vLLM's reload path; the experts' are loaded and processed as `processed` makes them (by
    `copies`, when given: apart_copies; or, where the transfer loaded them into a staging's `blocks`, processed from
    there: placement) and handed to vLLM's reload in kernel format (copied into the live parameters as they are).
    vLLM's reload path costs a weight loader call through its layerwise bookkeeping per expert and per shard (~0.2 ms
    each on a CPU: a tiny MoE of 28 experts at TP = 2 commits in 55 ms, in 25 this way). Else
    everything goes through vLLM's reload, processed as at its first load, and the live experts are read back
    against `processed` of the tensors handed for them (`experts`, or all), bit for bit: where they agree,
    `processed` is vLLM's own processing on this backend, and the caller may load those tensors apart from then on."""
    if experts and apart:
        with _quiet(expert_layers(model)):
            reload_weights(weights_iterator=(item for item in handed() if item[0] not in experts))
            own = processed_blocks(model, blocks) if blocks else \
                processed(model, (item for item in handed() if item[0] in experts), copies)
            reload_weights(weights_iterator=iter(own.items()), is_checkpoint_format=False)
        return []
    with first_load_processing(model):  # (vLLM skips its experts' processing otherwise)
        reload_weights(weights_iterator=handed())
    return live_mismatches(model, (item for item in handed() if not experts or item[0] in experts))


def apart_copies(model: torch.nn.Module, handed: Sequence[tuple[str, torch.Tensor]]) -> Copies | None:
    """Right after a commit of `handed` (the expert layers' tensors) whose live experts were read back equal to
    `processed` of them: the copies vLLM's loaders amount to for tensors of these names and shapes (learn_copies),
    when `processed` by them makes exactly the live experts; else None (they are loaded by vLLM's loaders)."""
    copies = learn_copies(model, [(name, tuple(t.shape)) for name, t in handed])
    if copies is None:
        return None
    for name, want in processed(model, handed, copies).items():
        module, _, param = name.rpartition(".")
        live = model.get_submodule(module)._parameters.get(param)
        if live is None or live.shape != want.shape or not torch.equal(live.data, want.data):
            return None
    return copies


@contextlib.contextmanager
def _quiet(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Within it, vLLM's reload does not warn that `layers` loaded no weights, nor which parameters a reload did not
    load: the two reloads of an update loaded apart load the experts and the rest, each without the other."""
    filters = ((logging.getLogger("vllm.model_executor.model_loader.reload.layerwise"),
                _Quiet("%s: Failed to load weights", {type(layer).__name__ for layer in layers})),
               (logging.getLogger("vllm.model_executor.model_loader.reload.inplace"),
                _Quiet("Following weights were not loaded from checkpoint: %s")))
    for logger, quiet in filters:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger, quiet in filters:
            logger.removeFilter(quiet)


class _Quiet(logging.Filter):
    """Drops the records of `message` (with its first argument in `first`, where given)."""

    def __init__(self, message: str, first: set[str] | None = None):
        super().__init__()
        self.message, self.first = message, first

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.message:
            return True
        return self.first is not None and not (record.args and record.args[0] in self.first)
