"""LoRA adapters on the wire (rlsync.lora): peft models split into what is sent and what is only
audited, and adapters checked against a base, each problem named, before any byte moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from torch import nn

from rlsync import lora
from rlsync.errors import InvalidArgument
from rlsync.publish import WeightMap
from rlsync.publish.source import module_source
from rlsync.transfer.manifest import Spec
from rlsync.transfer.v1.transfer_pb2 import LoraAdapter

BASE = {"model.layers.0.q_proj.weight": ((64, 32), None), "model.layers.0.q_proj.bias": ((64,), None),
        "model.layers.0.up_proj.weight": ((96, 32), None), "model.norm.weight": ((32,), None)}


def spec(name: str, *shape: int, dtype=torch.float32) -> Spec:
    return Spec(name, dtype, shape, 4 * int(torch.tensor(shape).prod()))


def adapter_specs(rank: int, modules=("model.layers.0.q_proj", "model.layers.0.up_proj")) -> list[Spec]:
    out = []
    for m in modules:
        rows, cols = BASE[f"{m}.weight"][0]
        out += [spec(lora.wire_name(m, "A"), rank, cols), spec(lora.wire_name(m, "B"), rows, rank)]
    return out


@given(st.integers(1, 64))
def test_an_adapter_of_any_rank_fits_its_base(rank):
    modules = lora.check(adapter_specs(rank), LoraAdapter(rank=rank, alpha=2.0 * rank), BASE)
    assert modules == {"model.layers.0.q_proj": (64, 32), "model.layers.0.up_proj": (96, 32)}


@pytest.mark.parametrize("specs, adapter, words", [
    (adapter_specs(4), LoraAdapter(rank=8, alpha=16), r"expected \[8, 32\]"),  # the manifest says another rank
    (adapter_specs(4)[:3], LoraAdapter(rank=4, alpha=8), "lacks lora_B"),
    ([spec(lora.wire_name("model.norm", "A"), 4, 32), spec(lora.wire_name("model.norm", "B"), 32, 4)],
     LoraAdapter(rank=4, alpha=8), "no linear layer 'model.norm'"),
    ([spec(lora.wire_name("model.gone", "A"), 4, 32)], LoraAdapter(rank=4, alpha=8), "no linear layer"),
    ([spec("model.layers.0.q_proj.weight", 64, 32)], LoraAdapter(rank=4, alpha=8), "not named as peft saves"),
    (adapter_specs(4), LoraAdapter(rank=4, alpha=0), "must both be positive"),
    ([], LoraAdapter(rank=4, alpha=8), "no tensors"),
    ([spec(lora.wire_name("model.layers.0.q_proj", "A"), 4, 32, dtype=torch.int8),
      spec(lora.wire_name("model.layers.0.q_proj", "B"), 64, 4)], LoraAdapter(rank=4, alpha=8), "not floating"),
])
def test_a_bad_adapter_is_refused_naming_the_problem(specs, adapter, words):
    with pytest.raises(InvalidArgument, match=words):
        lora.check(specs, adapter, BASE)


def test_a_rank_above_the_replicas_limit_is_refused():
    with pytest.raises(InvalidArgument, match="max_lora_rank 8"):
        lora.check(adapter_specs(16), LoraAdapter(rank=16, alpha=32), BASE, max_rank=8)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.ModuleDict({"q_proj": nn.Linear(32, 64), "up_proj": nn.Linear(32, 96)})
        self.norm = nn.LayerNorm(32)


def test_a_peft_model_publishes_its_adapter_and_audits_its_frozen_base():
    peft_model = get_peft_model(Tiny(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    source, _ = module_source(peft_model)
    assert source.adapter == LoraAdapter(rank=4, alpha=8)
    sent = {n: tuple(t.shape) for n, t in source.tensors.items()}
    assert sent == {"base_model.model.model.q_proj.lora_A.weight": (4, 32),
                    "base_model.model.model.q_proj.lora_B.weight": (64, 4),
                    "base_model.model.model.up_proj.lora_A.weight": (4, 32),
                    "base_model.model.model.up_proj.lora_B.weight": (96, 4)}
    assert set(source.frozen) == {"model.q_proj.weight", "model.q_proj.bias", "model.up_proj.weight",
                                  "model.up_proj.bias", "norm.weight", "norm.bias"}
    base = {n: (tuple(t.shape), None) for n, t in source.frozen.items()}
    assert lora.check(source.specs(), source.adapter, base) == {"model.q_proj": (64, 32), "model.up_proj": (96, 32)}


@pytest.mark.parametrize("config, words", [
    (LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), "DoRA"),
    (LoraConfig(r=4, target_modules=["q_proj"], bias="lora_only"), "trained biases"),
    (LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["norm"]), "modules_to_save"),
])
def test_adapters_rlsync_cannot_sync_are_refused(config, words):
    with pytest.raises(InvalidArgument, match=words):
        module_source(get_peft_model(Tiny(), config))


def test_a_peft_model_that_trains_more_than_its_adapter_is_refused():
    peft_model = get_peft_model(Tiny(), LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.base_model.model.norm.weight.requires_grad_(True)  # trained, but never sent: refused
    with pytest.raises(InvalidArgument, match="also trains.*norm.weight"):
        module_source(peft_model)
    with pytest.raises(InvalidArgument, match="only dtype applies"):
        module_source(get_peft_model(Tiny(), LoraConfig(r=4, target_modules=["q_proj"])),
                      WeightMap(rename={"x": "y"}))


def test_the_hf_engine_adapts_linear_layers_only():
    from rlsync.rollout.engines.hf_lora import Adapter

    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    adapter = Adapter(model, torch.device("cpu"), torch.float32)
    ok = [spec(lora.wire_name("1", "A"), 2, 8), spec(lora.wire_name("1", "B"), 8, 2)]
    with pytest.raises(InvalidArgument, match=r"\['0'\] are not linear layers"):
        adapter.staging([spec(lora.wire_name("0", "A"), 2, 10), spec(lora.wire_name("0", "B"), 8, 2)])
    staged = adapter.staging(ok)
    for view in staged.views.values():
        view.fill_(1.0)
    adapter.apply(LoraAdapter(rank=2, alpha=4), staged)
    x = torch.tensor([[1, 2]])
    lin = model[1].base_layer
    want = lin(model[0](x)) + 2.0 * (model[0](x) @ torch.ones(2, 8).T @ torch.ones(8, 2).T)
    assert torch.allclose(model(x), want) and not any(p.requires_grad for p in model.parameters())
    adapter.disable()
    assert torch.allclose(model(x), lin(model[0](x)))
