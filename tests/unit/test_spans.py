"""Byte views merged where they continue each other, and copied as they come (rlsync.transfer.spans):
property-tested over random layouts, both ends packed or scattered, tensors small and large."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlsync.transfer import spans
from rlsync.transfer.spans import coalesce, copy_all


def _views(sizes: list[int], packed: bool, fill: int) -> list[torch.Tensor]:
    """uint8 views of `sizes`: back to back in one buffer, or one allocation each."""
    if packed:
        flat = torch.arange(sum(sizes), dtype=torch.int64).add_(fill).to(torch.uint8)
        return list(flat.split(sizes))
    return [torch.full((n,), fill + i, dtype=torch.uint8) for i, n in enumerate(sizes)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=24), src_packed=st.booleans(),
       dst_packed=st.booleans(), small=st.integers(1, 80))
def test_every_byte_lands_and_only_runs_contiguous_on_both_sides_merge(sizes, src_packed, dst_packed, small):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spans, "SMALL", small)  # some copies small (one _foreach_copy_), some large
        _copy_and_check(sizes, src_packed, dst_packed)


def _copy_and_check(sizes: list[int], src_packed: bool, dst_packed: bool) -> None:
    src, dst = _views(sizes, src_packed, 7), _views(sizes, dst_packed, 0)
    for d in dst:
        d.zero_()
    items = [(s, s.untyped_storage().data_ptr(), d, d.untyped_storage().data_ptr()) for s, d in zip(src, dst)]
    merged = list(coalesce(iter(items)))  # a generator in, each run out as it ends
    assert len(merged) == (1 if src_packed and dst_packed else len(sizes))
    assert sum(s.numel() for s, _ in merged) == sum(sizes)
    copy_all(iter(merged))
    assert all(torch.equal(s, d) for s, d in zip(src, dst))


def test_nothing_to_copy_is_nothing_done():
    assert list(coalesce(iter([]))) == []
    copy_all(iter([]))


@settings(max_examples=80, deadline=None)
@given(experts=st.integers(1, 9), rows=st.integers(1, 5), cols=st.integers(1, 6), data=st.data())
def test_pieces_stepping_through_memory_alike_copy_as_one_and_land_as_each_would(experts, rows, cols, data):
    """stacked(): the per-expert rows of a fused [E, 2R, C] tensor (each expert's first R rows, as a tensor-
    parallel rank takes them) into per-expert places of a flat staging, in any order, with pieces that step
    otherwise among them (a cast one, one out of order in its slot), land byte for byte as a copy_ each; the
    alike ones become one pair."""
    fused = torch.randn(experts, 2 * rows, cols)
    staging = torch.full((experts * 3 * rows * cols,), float("nan"), dtype=torch.bfloat16)
    places = [staging[(3 * e) * rows * cols:(3 * e + 1) * rows * cols].view(rows, cols) for e in range(experts)]
    pairs = [(fused[e, :rows], places[e]) for e in range(experts)]
    odd = torch.randn(rows, cols)  # another storage: stays a pair of its own
    pairs.insert(data.draw(st.integers(0, len(pairs))), (odd, staging[rows * cols:2 * rows * cols].view(rows, cols)))
    order = data.draw(st.permutations(range(len(pairs))))
    pairs = [pairs[i] for i in order]
    expected = staging.clone()
    for src, dst in pairs:  # what a copy_ each lands
        expected[dst.data_ptr() // 2 - staging.data_ptr() // 2:][:dst.numel()].copy_(src.reshape(-1))
    out = spans.stacked(pairs)
    for src, dst in out:
        dst.copy_(src)
    assert torch.equal(staging.view(torch.int16), expected.view(torch.int16))
    assert len(out) == 2, [tuple(s.shape) for s, _ in out]  # the experts' pieces as one, the odd one apart
