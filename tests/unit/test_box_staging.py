"""BoxStaging (the vLLM worker's staging of its boxes) is pure: every full-shape view the loaders get
holds the staged box where the box lies, and stays inside the buffer."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.rollout.engines.vllm_layout import BoxStaging
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import chunks


@st.composite
def _tensors(draw):
    specs, boxes = [], []
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(1, 6), max_size=3)))
        specs.append(Spec(f"t{i}", torch.float32, shape, 4 * int(torch.Size(shape).numel())))
        if shape and draw(st.booleans()):  # a tensor-parallel slice along one dimension
            dim, n = draw(st.integers(0, len(shape) - 1)), draw(st.integers(1, 3))
            a, b = chunks(shape[dim], n)[draw(st.integers(0, n - 1))]
            box = tuple((a, b) if d == dim else (0, s) for d, s in enumerate(shape)) if b > a else None
        else:
            box = tuple((0, s) for s in shape)
        boxes.append(box if draw(st.integers(0, 5)) else None)  # some tensors this rank loads nothing of
    return specs, boxes


@settings(max_examples=200, deadline=None)
@given(_tensors())
def test_each_full_view_shows_the_staged_box_where_it_lies(case):
    specs, boxes = case
    staging = BoxStaging(specs, boxes, torch.device("cpu"))
    views = staging.views()
    for i, view in enumerate(views.values()):
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape) + 1000 * i)
    full = dict(staging.full())
    assert set(full) == set(views) == {s.name for s, b in zip(specs, boxes) if b is not None}
    for s in specs:
        if s.name in full:
            assert tuple(full[s.name].shape) == s.shape
            box = staging.boxes[s.name]
            assert torch.equal(full[s.name][tuple(slice(a, b) for a, b in box)], views[s.name])
    assert staging.nbytes() >= sum(v.numel() * 4 for v in views.values())
