"""The hf engine's LoRA adapter: peft's LoRA layers injected into the resident model by the first
adapter update, whose weights then go live like a full update's, by re-pointing parameters between
two decode steps. The base is never touched; a full update switches the adapter off (the served
policy is then exactly the new weights) until the next adapter update.

An adapter lands as sent (one copy, no per-tensor cast: the trainer keeps it in one flat buffer),
and the commit casts it into the engine's dtype with one kernel per buffer, into whichever of two
live buffers the model is not reading; buffers are reused from one update to the next.
"""

from __future__ import annotations

import torch

from rlsync.errors import InvalidArgument
from rlsync.flat import FlatStore, layout
from rlsync.lora import parse, peft_config, wire_name
from rlsync.transfer.v1.transfer_pb2 import LoraAdapter


class Adapter:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model, self.device, self.dtype = model, device, dtype
        self.injected: dict[tuple, str] = {}  # (rank, alpha, rslora, modules) -> peft adapter name
        self._layers: dict[tuple, dict[str, torch.nn.Parameter]] = {}  # per injected adapter: wire name -> param
        self.params: dict[str, torch.nn.Parameter] = {}  # the live adapter's parameters
        self.active: tuple | None = None  # the key of the adapter being served
        self._checked: tuple | None = None  # the layout last checked
        self._spare: FlatStore | None = None  # staging a committed update left: the next one lands there
        self._live: list[tuple] = []  # [(layout, store)]: what the model reads, and the one before

    def staging(self, specs) -> FlatStore:
        """Where an adapter is received, as sent. Refuses an adapter on a module that is not a linear
        layer (peft would adapt an embedding some other way)."""
        key = layout(specs)
        if key != self._checked:
            wrong = sorted(m for m in {parse(s.name)[0] for s in specs} if not self._is_linear(m))
            if wrong:
                raise InvalidArgument(f"LoRA adapter refused: {wrong[:3]} are not linear layers of this model "
                                      "(the hf engine adapts linear layers only)")
            self._checked = key
        if self._spare is not None and self._spare.layout == key:
            store, self._spare = self._spare, None
        else:
            store = FlatStore({s.name: (torch.Size(s.shape), s.dtype) for s in specs}, self.device)
        return store

    def _is_linear(self, name: str) -> bool:
        try:
            module = self.model.get_submodule(name)
        except AttributeError:
            return False
        return isinstance(getattr(module, "base_layer", module), torch.nn.Linear)  # once injected: peft's wrapper

    def apply(self, adapter: LoraAdapter, staged: FlatStore) -> None:
        """Makes `staged` the served adapter (call between two steps, the transfer complete). A new
        rank, alpha or set of modules injects a new peft adapter beside the old one instead."""
        shape = staged.layout  # as sent
        modules = {parse(name)[0] for name, _, _ in shape}
        key = (adapter.rank, adapter.alpha, adapter.use_rslora, frozenset(modules))
        if key not in self.injected:
            from peft import inject_adapter_in_model

            name = f"rlsync{len(self.injected)}"
            inject_adapter_in_model(peft_config(adapter, modules), self.model, adapter_name=name)
            self.injected[key] = name
            self._layers[key] = {wire_name(m, side): getattr(self.model.get_submodule(m), f"lora_{side}")[name].weight
                                 for m in modules for side in "AB"}
        live = self._live_buffer(shape)
        _cast_into(live, staged)
        params = self._layers[key]
        for wire, p in params.items():
            p.data = live.views[wire]
        if self.active != key:
            self._switch(self.injected[key])
            self.active = key
        self.params = params
        self._live = [(shape, live), *self._live[:1]]
        self._spare = staged

    def _live_buffer(self, shape: tuple) -> FlatStore:
        """The live buffer the model does not read now: the one before the current, when it fits."""
        if len(self._live) == 2 and self._live[1][0] == shape:
            return self._live[1][1]
        return FlatStore({name: (torch.Size(dims), self.dtype) for name, _, dims in shape}, self.device)

    def disable(self) -> None:
        """A full update replaced the model: serve it without any adapter."""
        if self.active is not None:
            self._switch(None)
            self.active = None

    def _switch(self, name: str | None) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in self.model.modules():
            if isinstance(m, BaseTunerLayer):
                if name is not None:
                    m.set_adapter(name)  # a layer without this adapter runs as its base
                m.enable_adapters(name is not None)
        for p in self.model.parameters():  # peft makes the active adapter trainable; nothing trains here
            p.requires_grad_(False)

    def checksums(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        from rlsync.transfer import audit

        return audit({n: p.data for n, p in self.params.items()}) if self.active is not None else {}


def _cast_into(live: FlatStore, staged: FlatStore) -> None:
    """The staged adapter in the live buffer's dtype: one kernel per buffer when every tensor of the
    adapter has one dtype (the same names and shapes give the same element layout), else per tensor."""
    if len(staged.buffers) == 1 and len(live.buffers) == 1:
        next(iter(live.buffers.values())).copy_(next(iter(staged.buffers.values())))
    else:
        for name, view in live.views.items():
            view.copy_(staged.views[name])
