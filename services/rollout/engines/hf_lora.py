"""The hf engine's LoRA adapter: peft's LoRA layers injected into the resident model by the first
adapter update, whose weights then go live like a full update's, by re-pointing parameters at the
received tensors between two decode steps (O(1)). The base is never touched; a full update switches
the adapter off (the served policy is then exactly the new weights) until the next adapter update.
"""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument
from rlsync.flat import FlatStore
from rlsync.lora import parse, peft_config, wire_name
from rlsync.transfer.v1.transfer_pb2 import LoraAdapter


class Adapter:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, device, dtype
        self.injected: dict[tuple, str] = {}  # (rank, alpha, rslora, modules) -> peft adapter name
        self.params: dict[str, torch.nn.Parameter] = {}  # wire name -> the live adapter's parameter
        self.active = False

    def staging(self, specs) -> FlatStore:
        """Where an adapter is received: in the engine's dtype (cast on arrival), like full weights.
        Refuses an adapter on a module that is not a linear layer (peft adapts embeddings otherwise)."""
        wrong = sorted(m for m in {parse(s.name)[0] for s in specs} if not self._is_linear(m))
        if wrong:
            raise InvalidArgument(f"LoRA adapter refused: {wrong[:3]} are not linear layers of this model "
                                  "(the hf engine adapts linear layers only)")
        return FlatStore({s.name: (torch.Size(s.shape), self.dtype) for s in specs}, self.device)

    def _is_linear(self, name: str) -> bool:
        try:
            module = self.model.get_submodule(name)
        except AttributeError:
            return False
        return isinstance(getattr(module, "base_layer", module), torch.nn.Linear)  # once injected: peft's wrapper

    def apply(self, adapter: LoraAdapter, staged: dict[str, torch.Tensor]) -> None:
        """Makes `staged` the served adapter (call between two steps). A new rank, alpha or set of
        modules injects a new peft adapter beside the old one and activates it instead."""
        modules = {parse(name)[0] for name in staged}
        key = (adapter.rank, adapter.alpha, adapter.use_rslora, frozenset(modules))
        if key not in self.injected:
            from peft import inject_adapter_in_model

            name = f"rlsync{len(self.injected)}"
            inject_adapter_in_model(peft_config(adapter, modules), self.model, adapter_name=name)
            self.injected[key] = name
        name = self.injected[key]
        params = {}
        for module in modules:
            layer = self.model.get_submodule(module)
            for side, weights in (("A", layer.lora_A), ("B", layer.lora_B)):
                params[wire_name(module, side)] = weights[name].weight
        for wire, p in params.items():
            p.data = staged[wire]
        self.params = params
        self._switch(name)

    def disable(self) -> None:
        """A full update replaced the model: serve it without any adapter."""
        if self.active:
            self._switch(None)

    def _switch(self, name: str | None) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in self.model.modules():
            if isinstance(m, BaseTunerLayer):
                if name is not None:
                    m.set_adapter(name)  # a layer without this adapter runs as its base
                m.enable_adapters(name is not None)
        for p in self.model.parameters():  # peft makes the active adapter trainable; nothing trains here
            p.requires_grad_(False)
        self.active = name is not None

    def checksums(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        from rlsync.transfer import audit_entry

        return {n: audit_entry(p.data) for n, p in self.params.items()} if self.active else {}
