"""Block FP8 across ranks that each hold boxes of a weight: the plan (which blocks the ranks exchange, who
sends which scale), every rank's FP8 values and scales equal bit for bit to the reference quantizer of the
whole tensor wherever the boxes cut it (the ranks simulated in one process: the exchange is a max), and,
with real torch.distributed (gloo, 2 ranks, separate processes), the same over a real all-reduce."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import interpreted, two_gloo_ranks
from rlsync.quant.fp8_blocks import quantize_blocks, scales_of
from rlsync.quant.fp8_shards import block_plan, exchange, partial_amax, quantize_box
from rlsync.transfer.routes import chunks

WORKER = Path(__file__).parent.parent / "fp8_shard_worker.py"


def _rows(ranges, n):
    return tuple((((a, b), (0, n)),) if b > a else () for a, b in ranges)


def test_plan_names_the_cut_blocks_and_one_sender_per_scale():
    plan = block_plan((300, 200), _rows(chunks(300, 2), 200))  # rows 0..149, 150..299: block row 1 is cut
    assert plan.grid == (3, 2) and plan.cut == (2, 3)
    assert plan.owned == ((((0, 2), (0, 2)),), (((2, 3), (0, 2)),))
    assert block_plan((256, 128), _rows(chunks(256, 2), 128)).cut == ()  # on block boundaries: no exchange
    one = block_plan((1, 300), _rows(chunks(1, 2), 300))  # fewer rows than ranks: rank 1 holds nothing
    assert one.cut == () and one.owned[1] == ()
    replicas = block_plan((200, 128), ((((0, 200), (0, 128)),),) * 2)  # both hold it whole: nothing to exchange
    assert replicas.cut == () and replicas.owned[0] == replicas.owned[1] == (((0, 2), (0, 1)),)
    columns = block_plan((128, 300), tuple((((0, 128), c),) for c in chunks(300, 2)))  # a tensor-parallel split
    assert columns.cut == (1,) and columns.owned == ((((0, 1), (0, 2)),), (((0, 1), (2, 3)),))


def _cuts(draw, size: int, parts: int) -> list[tuple[int, int]]:
    points = sorted(draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1)))
    edges = [0, *points, size]
    return list(zip(edges, edges[1:]))


@st.composite
def layouts(draw):
    """A weight's shape, block, and each rank's boxes: rows cut anywhere (FSDP2), columns (tensor parallel),
    a grid of both, two row ranges a rank (fused parts) or every box held twice (replicas)."""
    block = draw(st.sampled_from([(128, 128), (16, 8), (4, 4)]))
    m, n = draw(st.integers(1, 5 * block[0])), draw(st.integers(1, 5 * block[1]))
    kind = draw(st.sampled_from(["rows", "columns", "grid", "fused", "replicas", "fsdp"]))
    ranks = draw(st.integers(1, 5))
    if kind == "rows":
        held = [[((a, b), (0, n))] for a, b in _cuts(draw, m, ranks)]
    elif kind == "fsdp":
        held = [[((a, b), (0, n))] for a, b in chunks(m, ranks)]
    elif kind == "columns":
        held = [[((0, m), c)] for c in _cuts(draw, n, ranks)]
    elif kind == "grid":
        held = [[(r, c)] for r in _cuts(draw, m, 2) for c in _cuts(draw, n, 2)]
    elif kind == "fused":
        cuts = _cuts(draw, m, 2 * ranks)
        held = [[((a, b), (0, n)) for a, b in (cuts[r], cuts[r + ranks])] for r in range(ranks)]
    else:
        held = [[((a, b), (0, n))] for a, b in _cuts(draw, m, ranks) for _ in range(2)]
    held = tuple(tuple(b for b in boxes if b[0][1] > b[0][0] and b[1][1] > b[1][0]) for boxes in held)
    return (m, n), block, held, kind, draw(st.booleans()), draw(st.integers(0, 2 ** 16))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_rank_quantizes_its_boxes_as_the_whole_tensor_bit_for_bit(case):
    (m, n), block, held, kind, pow2, seed = case
    gen = torch.Generator().manual_seed(seed)
    whole = (torch.randn(m, n, generator=gen) * torch.logspace(-3, 2, m).unsqueeze(1)).to(torch.bfloat16)
    whole[torch.randint(0, m, (1,), generator=gen)] *= 1000  # one rank's rows hold a cut block's largest value
    q_ref, s_ref = quantize_blocks(whole, block, pow2)
    plan = block_plan((m, n), held, block)

    def cut(box):
        return whole[box[0][0]:box[0][1], box[1][0]:box[1][1]]

    amaxes = [partial_amax([(b, cut(b)) for b in boxes], (m, n), block) for boxes in held]
    offered = []  # what each rank hands the all-reduce; then every rank gets their max
    for a in amaxes:
        exchange([a.clone()], [plan], lambda t: offered.append(t) or t)
    for a in amaxes:
        exchange([a], [plan], lambda t: torch.stack(offered).amax(0))
    sent = torch.zeros(plan.grid, dtype=torch.int32)
    for r, boxes in enumerate(held):
        scale = scales_of(amaxes[r], pow2)
        for b in boxes:
            q = quantize_box(cut(b), b, scale, block)
            assert torch.equal(q.view(torch.uint8), cut_of(q_ref, b).view(torch.uint8)), (kind, r, b)
        for b in plan.owned[r]:
            assert torch.equal(cut_of(scale, b).view(torch.int32), cut_of(s_ref, b).view(torch.int32)), (kind, r, b)
            cut_of(sent, b).add_(1)
    holders = 2 if kind == "replicas" else 1  # every scale is declared by one rank (by each of its replicas)
    assert torch.equal(sent, torch.full(plan.grid, holders, dtype=torch.int32)), (kind, sent)


def cut_of(t, box):
    return t[box[0][0]:box[0][1], box[1][0]:box[1][1]]


def test_two_gloo_ranks_quantize_their_shards_as_the_whole_tensor_bit_for_bit():
    two_gloo_ranks(WORKER, results=12)


BOXES_RUN = """
import json, sys, torch
from rlsync.quant import fp8_box_kernel as bk, fp8_kernel as k
from rlsync.quant.fp8_blocks import FP8, scale_shape, scales_of
g = torch.Generator().manual_seed(int(sys.argv[1]))
kernel = lambda x: x.dim() == 2 and x.dtype in k._KINDS  # the box kernel over CPU tensors, interpreted
reference = lambda x: False
out = []
for (m, n), block, held, dtype in [
        ((300, 256), (128, 128), [[((0, 150), (0, 256))], [((150, 300), (0, 256))]], torch.bfloat16),  # FSDP2 rows
        ((300, 200), (128, 128), [[((0, 150), (0, 200))], [((150, 300), (0, 160)), ((150, 300), (160, 200))]],
         torch.bfloat16),  # rows 200 apart: no vectors
        ((130, 300), (128, 128), [[((0, 130), (0, 77))], [((0, 130), (77, 300))]], torch.float32),  # a column split
        ((40, 37), (16, 8), [[((0, 9), (0, 37)), ((23, 31), (0, 37))], [((9, 23), (0, 37)), ((31, 40), (0, 37))]],
         torch.float16),  # two row ranges a rank (fused parts): a rank's boxes share blocks
        ((33, 20), (4, 4), [[((0, 17), (0, 11)), ((17, 33), (11, 20))], [((0, 17), (11, 20)), ((17, 33), (0, 11))]],
         torch.bfloat16)]:  # a grid of both
    whole = (torch.randn(m, n, generator=g) * 10 ** torch.randint(-2, 3, (m, 1), generator=g)).to(dtype)
    cut = lambda b: whole[b[0][0]:b[0][1], b[1][0]:b[1][1]]
    grids = {}
    for name, on in (("kernel", kernel), ("reference", reference)):
        bk._on_kernel = on
        grids[name] = [torch.zeros(scale_shape((m, n), block)) for _ in held]
        bk.box_amax([(cut(b), b, grid) for boxes, grid in zip(held, grids[name]) for b in boxes], block)
    amax_equal = all(torch.equal(a, b) for a, b in zip(grids["kernel"], grids["reference"]))
    scale = scales_of(torch.stack(grids["kernel"]).amax(0), True)  # every rank's after the exchange
    whole_q = torch.empty(m, n, dtype=FP8)  # the one-weight kernel's values under these scales, interpreted
    k._quantize_block[scale.shape](whole, whole_q, scale, m, n, whole.stride(0), whole_q.stride(0), 1e-4, 448.0,
                                   BM=block[0], BN=block[1], MODE=2)
    bk._on_kernel = kernel
    boxes = [(cut(b), b, scale, torch.empty(cut(b).shape, dtype=FP8)) for rank in held for b in rank]
    bk.box_values(boxes, block)
    values_equal = all(torch.equal(q.view(torch.uint8), whole_q[b[0][0]:b[0][1], b[1][0]:b[1][1]].view(torch.uint8))
                       for _, b, _, q in boxes)
    aligned = [bk._aligned(x, b, q, block) for x, b, _, q in boxes]  # (the launch that says so: vectors)
    out.append([amax_equal, values_equal, aligned])
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_the_box_kernel_makes_the_references_amaxes_and_the_one_weight_kernels_values_under_tritons_interpreter(seed):
    """fp8_box_kernel (a sharded rank's boxes, one launch a dtype), run on the CPU by Triton's interpreter: each
    rank's partial amaxes exactly the reference's (rows and columns cut off block boundaries, a rank's boxes
    sharing blocks), and each box's FP8 values those of the one-weight kernel under the same scales, from the
    launch that hints its aligned boxes' loads as vectors and from the one that does not."""
    assert interpreted(BOXES_RUN, seed) == [[True, True, [True, True]], [True, True, [False] * 3],
                                            [True, True, [False, False]], [True, True, [False] * 4],
                                            [True, True, [False] * 4]]
