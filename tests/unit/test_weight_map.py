"""WeightMap: trainer names and dtypes -> the engine's tensors; every refusal names what to fix."""

from __future__ import annotations

import pytest
import torch

from rlsync.errors import InvalidArgument
from rlsync.publish.mapping import WeightMap

F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64
PARAMS = [("_orig_mod.model.embed.weight", (8, 4), F32), ("_orig_mod.model.q.weight", (4, 4), F32),
          ("_orig_mod.model.k.weight", (2, 4), F32), ("_orig_mod.value_head.weight", (1, 4), F32),
          ("_orig_mod.model.steps", (), I64)]


def names(entries):
    return [e.name for e in entries]


def test_default_publishes_everything_under_its_name_without_wrapper_prefixes():
    out = WeightMap().plan(PARAMS)
    assert names(out) == ["model.embed.weight", "model.q.weight", "model.k.weight", "value_head.weight", "model.steps"]
    assert all(len(e.parts) == 1 for e in out) and out[0].dtype == F32


def test_rename_filter_and_cast():
    out = WeightMap(rename=lambda n: n.removeprefix("model."), exclude=["value_head.*"], dtype=BF16).plan(PARAMS)
    assert names(out) == ["embed.weight", "q.weight", "k.weight", "steps"]
    assert [e.dtype for e in out] == [BF16, BF16, BF16, I64], "only floating-point tensors are cast"
    assert out[0].parts == ("_orig_mod.model.embed.weight",)
    only = WeightMap(rename={"model.embed.weight": "embed"}, include=["embed"]).plan(PARAMS)
    assert names(only) == ["embed"]


def test_a_dropped_name_is_not_published():
    out = WeightMap(rename=lambda n: None if n.endswith("steps") else n).plan(PARAMS)
    assert "model.steps" not in names(out)


def test_fuse_concatenates_along_dim0_and_tied_publishes_twice():
    wm = WeightMap(fuse={"model.qk.weight": ["model.q.weight", "model.k.weight"]},
                   tied={"lm_head.weight": "model.embed.weight"})
    out = {e.name: e for e in wm.plan(PARAMS)}
    assert out["model.qk.weight"].shape == (6, 4)
    assert out["model.qk.weight"].parts == ("_orig_mod.model.q.weight", "_orig_mod.model.k.weight")
    assert "model.q.weight" not in out
    assert out["lm_head.weight"].parts == out["model.embed.weight"].parts


@pytest.mark.parametrize("wm, fragment", [
    (WeightMap(rename=lambda n: "same"), "both map to 'same'"),
    (WeightMap(fuse={"x": ["model.q.weight", "nope"]}), "no tensor named ['nope']"),
    (WeightMap(fuse={"x": ["model.q.weight", "model.embed.weight"]}), "differ beyond dim 0"),
    (WeightMap(tied={"lm_head.weight": "missing"}), "no tensor 'missing'"),
    (WeightMap(include=["nothing*"]), "nothing to publish"),
])
def test_mapping_mistakes_are_refused_with_the_tensor_named(wm, fragment):
    with pytest.raises(InvalidArgument) as e:
        wm.plan(PARAMS[:3] if "differ" not in fragment else
                [("model.q.weight", (4, 4), F32), ("model.embed.weight", (8, 5), F32)])
    assert fragment in str(e.value)


def test_wrapper_names_are_whole_components_not_substrings():
    wm = WeightMap()
    assert wm.engine_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") == \
        "model.layers.0.mlp.weight"
    assert wm.engine_name("vision_tower.submodule.weight") == "vision_tower.submodule.weight"
    assert wm.engine_name("adapter_module.proj") == "adapter_module.proj"
    assert wm.engine_name("encoder.module.weight") == "encoder.module.weight", "only DDP's leading 'module'"
    assert wm.engine_name("module.weight") == "weight"
