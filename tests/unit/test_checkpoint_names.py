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


def test_replicas_that_take_them_stacked_get_one_tensor_of_the_same_bytes_and_name_its_experts_tensors_alike():
    """The plan's stacked entry is [E, n, R, H] under the parameter's name; the receiver's stacked_specs names the
    same per-expert tensors the per-expert plan sends, in the same order, and their bytes are the stacked bytes."""
    from rlsync.checkpoint_names import Stacked, stacked_specs, stacked_tensors, unstacked_items
    from rlsync.transfer.manifest import Spec

    name = "m.mlp.experts.gate_up_proj"
    (entry,) = WeightMap().plan([(name, (E, 2 * R, H), torch.float32)], [GATE_UP], stacked={name})
    assert (entry.name, entry.shape, entry.view) == (name, (E, 2, R, H), Stacked(2))
    per_expert = WeightMap().plan([(name, (E, 2 * R, H), torch.float32)], [GATE_UP])
    norm = Spec("m.norm.weight", torch.float32, (H,), 4 * H)
    stack = stacked_specs([norm, Spec(name, torch.float32, entry.shape, 4 * E * 2 * R * H)], [GATE_UP, DOWN])
    assert stack.flat == (norm, *(Spec(e.name, torch.float32, e.shape, 4 * R * H) for e in per_expert))
    assert stack.members == {1: range(1, 1 + 2 * E)}
    gate_up = torch.randn(E, 2 * R, H)
    sent = stacked_tensors({name: gate_up, "m.norm.weight": torch.ones(H)}, [GATE_UP])
    assert sent[name].shape == (E, 2, R, H) and sent[name].data_ptr() == gate_up.data_ptr()
    loaded = dict(unstacked_items({**sent}, stack))
    want = checkpoint_tensors({"m.norm.weight": torch.ones(H), name: gate_up}, [GATE_UP])
    assert list(loaded) == list(want) and all(torch.equal(loaded[n], want[n]) for n in want)
    # a tensor of the parameter's name in another shape, or one no rule fuses, is the receiver's to refuse as it is
    odd = [Spec(name, torch.float32, (E, 2 * R, H), 4 * E * 2 * R * H), Spec("x.w", torch.float32, (2, 3, 4), 96)]
    assert stacked_specs(odd, [GATE_UP]).members == {}


def test_a_box_of_the_parameter_is_a_box_of_it_stacked_where_its_rows_keep_to_a_source_or_take_whole_ones():
    from rlsync.checkpoint_names import Stacked

    view, shape = Stacked(2), (E, 2 * R, H)
    assert view.box(((0, E), (0, 2 * R), (0, H)), shape) == ((0, E), (0, 2), (0, R), (0, H))
    assert view.box(((1, 2), (R + 1, 2 * R), (2, 5)), shape) == ((1, 2), (1, 2), (1, R), (2, 5))
    assert view.box(((0, 1), (R, 2 * R), (0, H)), shape) == ((0, 1), (1, 2), (0, R), (0, H))
    assert view.box(None, shape) is None
    with pytest.raises(ValueError, match="cut a source's 4 rows"):
        view.box(((0, E), (1, R + 1), (0, H)), shape)


def test_the_experts_boxes_join_into_one_box_of_the_stacked_tensor_and_their_views_into_one_view():
    """Tensor parallel: every expert's rows r of each source -> one box; expert parallel: a run of whole experts ->
    one box; their views, one run of a parameter in order -> one stacked view, else none."""
    from rlsync.checkpoint_names import stacked_boxes, stacked_specs, stacked_views
    from rlsync.transfer.manifest import Spec

    name = "m.mlp.experts.gate_up_proj"
    stack = stacked_specs([Spec(name, torch.float32, (E, 2, R, H), 4 * E * 2 * R * H),
                           Spec("m.norm.weight", torch.float32, (H,), 4 * H)], [GATE_UP])
    tp = [((R // 2, R), (0, H))] * (2 * E) + [((0, H),)]
    assert stacked_boxes(stack, tp) == [((0, E), (0, 2), (R // 2, R), (0, H)), ((0, H),)]
    ep = [((0, R), (0, H)) if m // 2 in (1, 2) else None for m in range(2 * E)] + [None]
    assert stacked_boxes(stack, ep) == [((1, 3), (0, 2), (0, R), (0, H)), None]
    w13 = torch.randn(E, 2 * R, H)
    views = {s.name: w13[m // 2, (m % 2) * R:(m % 2 + 1) * R] for m, s in enumerate(stack.flat[:-1])}
    views["m.norm.weight"] = torch.ones(H)
    folded = stacked_views(stack, views)
    assert folded[name].data_ptr() == w13.data_ptr() and torch.equal(folded[name], w13.view(E, 2, R, H))
    swapped = {**views, stack.flat[0].name: views[stack.flat[1].name], stack.flat[1].name: views[stack.flat[0].name]}
    assert stacked_views(stack, swapped) is None


def test_a_store_under_checkpoint_names_is_received_into_and_audited_under_a_stacked_manifests_names():
    """FlatStore.views_for: a manifest's stacked tensor is the run of its experts' tensors the store spans (one buffer:
    a one-copy receive where the manifest lies as the store does); another dtype is cast on arrival, another order
    is a delta base still, and a name the store neither holds nor spans gets its own views (a receiver then names
    what is missing)."""
    from rlsync.transfer.manifest import Spec

    name = "m.mlp.experts.gate_up_proj"
    specs, groups = checkpoint_groups({name: (torch.Size([E, 2 * R, H]), torch.float32),
                                       "m.norm.weight": (torch.Size([H]), torch.float32)}, [GATE_UP])
    store = FlatStore(specs, spans={n: g for n, g in groups.items() if len(g) > 1})
    stacked = (Spec(name, torch.float32, (E, 2, R, H), 4 * E * 2 * R * H), Spec("m.norm.weight", torch.float32, (H,),
                                                                                4 * H))
    views = store.views_for(stacked)
    assert list(views) == [name, "m.norm.weight"] and store.laid_out_as(stacked) and store.holds(stacked)
    assert store.whole_for(stacked) is not None, "one buffer: the whole update lands in one copy"
    views[name].copy_(torch.arange(E * 2 * R * H, dtype=torch.float32).view(E, 2, R, H))
    assert torch.equal(store.views["m.mlp.experts.2.up_proj.weight"], views[name][2, 1])
    half = tuple(s._replace(dtype=torch.bfloat16, nbytes=s.nbytes // 2) for s in stacked)
    assert store.views_for(half)[name].data_ptr() == views[name].data_ptr(), "cast on arrival into the same run"
    assert not store.laid_out_as(half) and store.whole_for(half) is None and not store.holds(half)
    backwards = stacked[::-1]
    assert store.views_for(backwards)[name].data_ptr() == views[name].data_ptr()
    assert store.holds(backwards) and not store.laid_out_as(backwards), "a delta base in any order; one copy: not"
    for odd in [(stacked[0]._replace(name="m.mlp.experts.down_proj"), stacked[1]), stacked[:1]]:
        assert not store.laid_out_as(odd) and not store.holds(odd), odd
    assert store.views_for(stacked[:1])[name].shape == (E, 2, R, H), "a part of the store: its names found"
