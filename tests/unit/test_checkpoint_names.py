"""Fused experts under the checkpoint's names: the rules transformers' conversion mapping gives, the
per-expert views they make (no copy), the publisher's plan, and a flat store's fused spans."""

from __future__ import annotations

import pytest
import torch

from rlsync.checkpoint_names import Unfuse, checkpoint_groups, checkpoint_tensors, expert_rules
from rlsync.errors import InvalidArgument
from rlsync.flat import FlatStore
from rlsync.publish.mapping import WeightMap

GATE_UP = Unfuse("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"))
DOWN = Unfuse("mlp.experts.down_proj", ("mlp.experts.*.down_proj.weight",))
E, R, H = 3, 4, 5  # experts, rows of each (moe_intermediate_size), hidden


def _tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, num_experts=E, num_experts_per_tok=1, moe_intermediate_size=R,
                            intermediate_size=8, vocab_size=32)
    return Qwen3MoeForCausalLM(config)


def test_rules_come_from_transformers_conversion_mapping_and_dense_models_have_none():
    assert set(expert_rules(_tiny_qwen3_moe())) == {GATE_UP, DOWN}
    assert expert_rules(torch.nn.Linear(2, 2)) == ()


def test_per_expert_tensors_are_contiguous_views_gate_before_up():
    gate_up, down = torch.randn(E, 2 * R, H), torch.randn(E, H, R)
    out = checkpoint_tensors({"l.mlp.experts.gate_up_proj": gate_up, "l.mlp.experts.down_proj": down,
                              "l.norm.weight": torch.ones(H)}, [GATE_UP, DOWN])
    assert list(out)[:3] == ["l.mlp.experts.0.gate_proj.weight", "l.mlp.experts.0.up_proj.weight",
                             "l.mlp.experts.1.gate_proj.weight"]
    assert torch.equal(out["l.mlp.experts.2.up_proj.weight"], gate_up[2, R:])
    assert torch.equal(out["l.mlp.experts.1.down_proj.weight"], down[1])
    for n, t in out.items():
        assert t.is_contiguous(), n
    assert out["l.mlp.experts.2.gate_proj.weight"].data_ptr() == gate_up[2].data_ptr(), "a view, not a copy"


def test_saving_and_loading_through_transformers_agree_with_the_views(tmp_path):
    from safetensors.torch import load_file

    model = _tiny_qwen3_moe()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    views = checkpoint_tensors(dict(model.named_parameters()), expert_rules(model))
    assert set(views) == set(saved)
    for n, t in saved.items():
        assert torch.equal(views[n], t), n


def test_the_plan_publishes_per_expert_entries_after_renaming():
    plan = WeightMap(rename=lambda n: n.removeprefix("policy.")).plan(
        [("policy.m.mlp.experts.gate_up_proj", (E, 2 * R, H), torch.float32)], [GATE_UP])
    assert [e.name for e in plan][:2] == ["m.mlp.experts.0.gate_proj.weight", "m.mlp.experts.0.up_proj.weight"]
    assert all(e.shape == (R, H) and e.parts == ("policy.m.mlp.experts.gate_up_proj",) for e in plan)
    assert len(plan) == 2 * E
    with pytest.raises(InvalidArgument, match="views of a fused experts parameter"):
        WeightMap(fuse={"x": ["m.mlp.experts.0.gate_proj.weight", "m.mlp.experts.0.up_proj.weight"]}).plan(
            [("m.mlp.experts.gate_up_proj", (E, 2 * R, H), torch.float32)], [GATE_UP])


def test_a_store_under_checkpoint_names_holds_each_fused_parameter_as_one_span():
    specs, groups = checkpoint_groups({"m.mlp.experts.gate_up_proj": (torch.Size([E, 2 * R, H]), torch.float32),
                                       "m.norm.weight": (torch.Size([H]), torch.float32)}, [GATE_UP])
    store = FlatStore(specs)
    fused = store.span(groups["m.mlp.experts.gate_up_proj"], (E, 2 * R, H))
    fused.copy_(torch.arange(fused.numel(), dtype=torch.float32).view(fused.shape))
    assert torch.equal(store.views["m.mlp.experts.1.up_proj.weight"], fused[1, R:])
    assert store.span(groups["m.norm.weight"], (H,)).data_ptr() == store.views["m.norm.weight"].data_ptr()
    with pytest.raises(ValueError, match="does not follow"):
        store.span(["m.mlp.experts.0.gate_proj.weight", "m.mlp.experts.1.gate_proj.weight"], (2, R, H))
