"""Where each checkpoint tensor lies inside a vLLM worker's live parameters, found by vLLM's own loaders,
so that an update can land straight in them: one copy from the trainer's memory, no staging, no loader.

`direct_views` runs the model's `load_weights` once on meta probes (no memory, no data) into meta shadows
of the parameters (vllm_layout.shadowed) and records every copy the loaders make. A tensor whose every
element lands, in order, in one contiguous run of one parameter (a merged qkv's q rows, gate_up's gate
half, a padded vocabulary's first rows, a norm's weight) gets that run as a view of the live parameter;
where any tensor does not (a transpose, a cast before the copy, a column slice under tensor parallelism,
a tensor the loaders skip), or a parameter is processed after loading (quantized or prepacked, as on vLLM's
CPU build), there are no views and the update is staged and loaded by vLLM's reload path instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlsync.rollout.engines.vllm_layout import shadow_param, shadowed
from rlsync.transfer.manifest import Spec

# Modules whose parameters are used as loaded (no processing after loading) on CUDA.
_AS_LOADED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)  # a loader clearing padding: not a value change


class _Copies(TorchDispatchMode):
    """Records copy_(dst, src) between meta tensors as (dst storage, dst run, src storage, src run): a run
    is (offset, numel) when the view is dense in row-major order, else None."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[int, tuple[int, int] | None, int, tuple[int, int] | None]] = []
        self.changed: set[int] = set()  # storages some other in-place op wrote (a scale, a permutation...)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.copies.append((_storage(dst), _run(dst), _storage(src), _run(src) if src.shape == dst.shape else None))
        elif func not in _FILLS and func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            self.changed.add(_storage(args[0]))
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _run(t: torch.Tensor) -> tuple[int, int] | None:
    return (t.storage_offset(), t.numel()) if t.is_contiguous() else None


class Placement(NamedTuple):
    """Where one checkpoint tensor lands: the parameter `name` of `module` (of the shape vLLM recorded
    before processing it), its flat elements [offset, offset + numel)."""

    module: torch.nn.Module
    name: str
    shape: torch.Size
    offset: int
    numel: int


def placements(model: torch.nn.Module, specs: Sequence[Spec]) -> tuple[dict[str, Placement] | None, str]:
    """({checkpoint name: its Placement}, "") as vLLM's loaders place the tensors of `specs`, or (None, why
    some tensor is not one run of one parameter)."""
    probes = {s.name: torch.empty(tuple(s.shape), dtype=s.dtype, device="meta") for s in specs}
    sources = {_storage(t): name for name, t in probes.items()}
    shapes: dict[int, torch.Size] = {}

    def make(template, module, name):
        shadow = shadow_param(template, module)
        shapes[id(shadow)] = template.shape
        return shadow

    recorder = _Copies()
    with shadowed(model, make) as owners:
        targets = {}  # shadow storage -> (module, name, the shape vLLM recorded before processing)
        for module in model.modules():
            for shadow in module._parameters.values():
                if shadow is not None and id(shadow) in owners:
                    targets[_storage(shadow)] = (*owners[id(shadow)], shapes[id(shadow)])
        with recorder:
            model.load_weights(iter(probes.items()))
    if changed := recorder.changed & set(targets):
        module, name, _ = targets[next(iter(changed))]
        return None, f"a loader changes {type(module).__name__}.{name} in place after copying it"
    runs: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> [(src offset, numel, dst storage, dst offset)]
    for dst, dst_run, src, src_run in recorder.copies:
        name = sources.get(src)
        if name is None or dst not in targets:
            continue  # a copy between the loader's own tensors (a fill of padding, say)
        if dst_run is None or src_run is None:
            return None, f"{name} is not copied as a contiguous run of its values"
        runs.setdefault(name, []).append((src_run[0], src_run[1], dst, dst_run[0]))
    out = {}
    for s in specs:
        pieces = sorted(runs.get(s.name, []))
        if not pieces:
            return None, f"the loaders do not load {s.name}"
        delta, covered = pieces[0][3] - pieces[0][0], 0
        for src_off, numel, dst, dst_off in pieces:
            if dst != pieces[0][2] or dst_off - src_off != delta or src_off != covered:
                return None, f"{s.name} is not one run of one parameter"
            covered += numel
        if covered != math.prod(s.shape):
            return None, f"{s.name} is loaded in part"
        out[s.name] = Placement(*targets[pieces[0][2]], delta, covered)
    return out, ""


def direct_views(model: torch.nn.Module, specs: Sequence[Spec]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """({checkpoint name: the view of a live parameter it loads into}, "") or (None, why not)."""
    found, why = placements(model, specs)
    if found is None:
        return None, why
    if mla := next((m for m in model.modules() if "MLA" in type(m).__name__), None):
        return None, f"{type(mla).__name__} derives tensors from its weights after loading"
    views, shapes = {}, {s.name: tuple(s.shape) for s in specs}
    for name, (module, pname, recorded, offset, numel) in found.items():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method).__name__ not in _AS_LOADED:
            return None, f"{name} lands in a parameter processed after loading ({type(method).__name__})"
        live = module._parameters.get(pname)
        if live is None or live.shape != recorded:
            return None, f"{name} lands in a parameter processed after loading (it is gone or reshaped)"
        if live.device.type != "cuda":
            return None, f"{name} lands in a parameter on {live.device} (vLLM processes its weights off the GPU)"
        views[name] = live.data.view(-1)[offset:offset + numel].view(shapes[name])
    return views, ""
