"""Fused-expert layers reloaded the way vLLM loads them the first time, so that a refit computes what it verifies.

vLLM 0.32's unquantized MoE method (`UnquantizedFusedMoEMethod._setup_kernel`) takes any processing after a
kernel was built for a weight update, and then skips its experts' own processing of the layer
(`fused_experts.process_weights_after_loading`). On the CPU build that processing is what pads the
intermediate size to the kernel's alignment and prepacks w13 / w2 into `cpu_fused_moe`'s grouped-gemm layout:
a reload hands the kernel plain row-major experts it reads as packed (wrong tokens, though every byte it was
given is right), and where the padding changes a shape (TP = 2 of the tiny MoE: 16 -> 32 rows) the layerwise
copy-back fails on a size mismatch. Forgetting the built kernel before the reload sends vLLM down its own
first-load path (pad, prepack, a kernel built anew over the same weights), whose results the reload copies
back into the parameters the engine runs with.

`live_mismatches` then reads what the engine computes with: it loads the tensors handed to the reload again
into scratch copies of the expert layers' parameters, by vLLM's own loaders, has the experts process them
(pad, prepack), and compares the result with the live parameters, bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator

import torch

from rlsync.rollout.engines.vllm_layout import shadow_param, shadowed


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


def live_mismatches(model: torch.nn.Module, handed: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The live parameters of expert layers (`module.param`) that differ from what their experts' processing makes
    of the tensors `handed` to the reload; [] when every one is equal (or no layer's experts process it)."""
    layers = {id(mod): mod for mod in model.modules()
              if (m := getattr(mod, "quant_method", None)) is not None and _processes_layer(m)}
    if not layers:
        return []
    scratch: dict[int, dict[str, torch.Tensor]] = {}

    def make(template, module, name):
        if id(module) not in layers:
            return shadow_param(template, module)  # (the other layers' loaders write nothing real)
        t = shadow_param(template, module, device=str(module._parameters[name].device)
                         if module._parameters.get(name) is not None else "cpu")
        scratch.setdefault(id(module), {})[name] = t
        return t

    with shadowed(model, make):
        model.load_weights(iter(handed))
    names = {id(mod): name for name, mod in model.named_modules()}
    wrong = []
    for key, params in scratch.items():
        layer, standin = layers[key], torch.nn.Module()
        for attr in ("moe_config", "activation"):  # (what the experts read of a layer to choose their kernel)
            if hasattr(layer, attr):
                setattr(standin, attr, getattr(layer, attr))
        for name, t in params.items():
            standin.register_parameter(name, torch.nn.Parameter(t.data, requires_grad=False))
        experts = copy.copy(layer.quant_method.moe_kernel.fused_experts)  # (its own state stays the live one's)
        experts.process_weights_after_loading(standin)
        for name, want in standin.named_parameters():
            live = layer._parameters.get(name)
            if live is None or live.shape != want.shape or not torch.equal(live.data, want.data):
                wrong.append(f"{names[key]}.{name}")
    return wrong
