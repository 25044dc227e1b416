"""BoxStaging (the vLLM worker's staging of its boxes) is pure: every full-shape view the loaders get
holds the staged box where the box lies, and stays inside the buffer; expert tensors placed in blocks
(vllm_experts.placement) lie where vLLM's loaders would copy them."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.rollout.engines.vllm_experts import Copies, placement
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
    views = staging.views
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


def _experts_case(experts: int = 3, inter: int = 4, hidden: int = 5):
    """Rank 0 of 2 of a tensor-parallel expert layer: per expert gate / up [I, H] (its rows 0:I/2) and down [H, I]
    (its columns 0:I/2), and a norm loaded whole; the copies vLLM's loaders make of them into w13 [E, I, H] (gate
    then up per expert) and w2 [E, H, I/2]."""
    half = inter // 2
    specs, boxes = [Spec("norm", torch.float32, (hidden,), 4 * hidden)], [((0, hidden),)]
    copies = Copies({}, {(1, "w13"): ((experts, inter, hidden), torch.float32),
                         (1, "w2"): ((experts, hidden, half), torch.float32)})
    for e in range(experts):
        for j, part in enumerate(("gate", "up")):
            specs.append(Spec(f"{e}.{part}", torch.float32, (inter, hidden), 4 * inter * hidden))
            boxes.append(((0, half), (0, hidden)))
            copies.boxes.setdefault((1, "w13"), []).append(
                (f"{e}.{part}", (slice(e, e + 1), slice(j * half, (j + 1) * half), slice(0, hidden)),
                 (slice(0, half), slice(0, hidden))))
        specs.append(Spec(f"{e}.down", torch.float32, (hidden, inter), 4 * inter * hidden))
        boxes.append(((0, hidden), (0, half)))
        copies.boxes.setdefault((1, "w2"), []).append(
            (f"{e}.down", (slice(e, e + 1), slice(0, hidden), slice(0, half)), (slice(0, hidden), slice(0, half))))
    return specs, boxes, copies


def test_expert_tensors_placed_in_blocks_are_staged_where_vllms_loaders_copy_them():
    specs, boxes, copies = _experts_case()
    placed = placement(copies, specs, boxes)
    assert placed is not None
    staging = BoxStaging(specs, boxes, torch.device("cpu"), placed)
    views = staging.views
    for i, view in enumerate(views.values()):
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(i)))
    blocks = staging.blocks()
    for (_, param), boxes_ in copies.boxes.items():
        for name, into, _ in boxes_:
            assert torch.equal(blocks[(1, param)][into].reshape(views[name].shape), views[name])
    assert [name for name, _ in staging.full()] == ["norm"]  # (the experts are not handed to the loaders)
    assert staging.nbytes() == 4 * sum(v.numel() for v in views.values())  # (the blocks are the boxes, no more)


def test_expert_tensors_are_not_placed_unless_each_is_one_whole_box_of_its_dtype_and_they_tile_their_blocks():
    specs, boxes, copies = _experts_case()
    w13 = copies.boxes[(1, "w13")]
    cases = {
        "a tensor in another dtype": ([Spec(s.name, torch.bfloat16, s.shape, s.nbytes // 2) if s.name == "0.gate"
                                       else s for s in specs], boxes, copies),
        "a copy of part of a staged box": (specs, boxes, Copies({**copies.boxes, (1, "w13"): [
            (n, into, (slice(0, 1), src[1])) if n == "0.gate" else (n, into, src) for n, into, src in w13]},
            copies.params)),
        "a block not tiled": (specs, boxes, Copies({**copies.boxes, (1, "w13"): w13[1:]}, copies.params)),
        "a tensor copied twice": (specs, boxes, Copies({**copies.boxes, (1, "w13"): [w13[0], *w13]}, copies.params)),
        "a box that is no run of its block": (specs, boxes, Copies(copies.boxes, {
            **copies.params, (1, "w2"): ((3, 5, 4), torch.float32)})),
    }
    for why, (s, b, c) in cases.items():
        assert placement(c, s, b) is None, why
