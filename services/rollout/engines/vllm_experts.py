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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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
