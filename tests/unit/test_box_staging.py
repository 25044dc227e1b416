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


def _stacked_case(experts: int = 3, inter: int = 4, hidden: int = 5):
    """_experts_case's tensors as a trainer stacks them: gate_up [E, 2, I, H] and down [E, 1, H, I], whose boxes are
    rank 0's rows (columns) 0:I/2 of every expert's."""
    from rlsync.checkpoint_names import Unstacked, stacked_boxes

    flat, flat_boxes, copies = _experts_case(experts, inter, hidden)
    # (the norm; then gate and up of each expert in turn, then each down: the stacked tensors' orders)
    order = [0] + [1 + 3 * e + j for e in range(experts) for j in (0, 1)] + [1 + 3 * e + 2 for e in range(experts)]
    flat, flat_boxes = [flat[i] for i in order], [flat_boxes[i] for i in order]
    specs = (flat[0], Spec("gate_up", torch.float32, (experts, 2, inter, hidden), 8 * experts * inter * hidden),
             Spec("down", torch.float32, (experts, 1, hidden, inter), 4 * experts * inter * hidden))
    stack = Unstacked(specs, tuple(flat), {1: range(1, 1 + 2 * experts), 2: range(1 + 2 * experts, 1 + 3 * experts)})
    return stack, flat_boxes, stacked_boxes(stack, flat_boxes), copies


def test_a_stacked_box_is_staged_as_one_and_handed_to_the_loaders_as_its_experts_full_shape_tensors():
    stack, flat_boxes, boxes, _ = _stacked_case()
    assert boxes[1:] == [((0, 3), (0, 2), (0, 2), (0, 5)), ((0, 3), (0, 1), (0, 5), (0, 2))]
    staging = BoxStaging(stack.specs, boxes, torch.device("cpu"), stack=stack)
    for i, view in enumerate(staging.views.values()):
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(i)))
    full = dict(staging.full())
    assert list(full) == [s.name for s in stack.flat]
    for m, (s, box) in enumerate(zip(stack.flat[1:], flat_boxes[1:])):
        stacked = "gate_up" if m < 6 else "down"
        e, k = divmod(m, 2) if m < 6 else (m - 6, 0)
        assert tuple(full[s.name].shape) == s.shape
        assert torch.equal(full[s.name][tuple(slice(a, b) for a, b in box)], staging.views[stacked][e, k]), s.name
    assert staging.nbytes() >= 4 * sum(v.numel() for v in staging.views.values())


def test_a_stacked_box_lies_in_its_block_where_vllms_loaders_copy_its_experts():
    from rlsync.rollout.engines.vllm_experts import stacked_placement

    stack, flat_boxes, boxes, copies = _stacked_case()
    placed = stacked_placement(stack, placement(copies, stack.flat, flat_boxes), boxes, flat_boxes)
    assert placed is not None and [name for name, _, _ in placed.at] == ["gate_up", "down"]
    staging = BoxStaging(stack.specs, boxes, torch.device("cpu"), placed, stack)
    gate_up, down = staging.views["gate_up"], staging.views["down"]
    gate_up.copy_(torch.randn(gate_up.shape))
    down.copy_(torch.randn(down.shape))
    blocks = staging.blocks()
    assert torch.equal(blocks[(1, "w13")], gate_up.reshape(3, 4, 5)) and torch.equal(blocks[(1, "w2")], down[:, 0])
    assert staging.nbytes() == 4 * (gate_up.numel() + down.numel() + 5)  # (the blocks are the boxes, no more)
    flat_placed = placement(copies, stack.flat, flat_boxes)
    shuffled = flat_placed._replace(at=tuple((n, b, 0 if n == "2.gate" else s) for n, b, s in flat_placed.at))
    assert stacked_placement(stack, shuffled, boxes, flat_boxes) is None, "an expert not where its stacked box puts it"
    narrower = [((0, 1), (0, 5)) if s.name == "1.up" else b for s, b in zip(stack.flat, flat_boxes)]
    assert stacked_placement(stack, flat_placed, boxes, narrower) is None, "an expert whose own box is another"
