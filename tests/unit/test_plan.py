"""Bucket planning is pure: exhaustive and property-based checks, no I/O."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.errors import InvalidArgument
from rlsync.transfer.checksum import as_bytes
from rlsync.transfer.dtypes import DTYPES
from rlsync.transfer.plan import bytes_per_tensor, plan_buckets


@pytest.mark.parametrize("bad", [0, -1, -4096, 1.5, None, "64"])
def test_bad_bucket_size_is_refused(bad):
    with pytest.raises(InvalidArgument, match="bucket size must be a positive number of bytes"):
        plan_buckets([10, 20], bad)


def test_negative_tensor_size_is_refused():
    with pytest.raises(InvalidArgument, match="negative size"):
        plan_buckets([4, -1], 8)


def test_empty_and_zero_sized():
    assert plan_buckets([], 8) == []
    assert plan_buckets([0, 0], 8) == []
    plan = plan_buckets([0, 5, 0], 8)
    assert [(s.tensor, s.src, s.length, s.dst) for s in plan[0].slices] == [(1, 0, 5, 0)]


def test_tensor_larger_than_bucket_is_sliced_in_order():
    plan = plan_buckets([10], 3)
    assert [b.nbytes for b in plan] == [3, 3, 3, 1]
    assert [(s.src, s.length) for b in plan for s in b.slices] == [(0, 3), (3, 3), (6, 3), (9, 1)]


def _check(sizes, bucket):
    plan = plan_buckets(sizes, bucket)
    assert bytes_per_tensor(plan, len(sizes)) == list(sizes)
    for i, b in enumerate(plan):
        assert b.index == i
        assert 0 < b.nbytes <= bucket
        if i < len(plan) - 1:
            assert b.nbytes == bucket, "every bucket but the last is full"
        offset = 0
        for s in b.slices:
            assert s.dst == offset and s.length > 0
            offset += s.length
        assert offset == b.nbytes
    # each tensor's slices cover it front to back without gaps
    nxt = [0] * len(sizes)
    order = []
    for b in plan:
        for s in b.slices:
            assert s.src == nxt[s.tensor]
            nxt[s.tensor] += s.length
            order.append(s.tensor)
    assert order == sorted(order), "tensors are packed in manifest order"


@pytest.mark.parametrize("bucket", [1, 2, 3, 5, 7, 8, 64, 1000])
def test_exhaustive_small_cases(bucket):
    for sizes in ([1], [7, 0, 9], [8, 8, 8], [0], [13, 1, 2, 3, 100], [1] * 17):
        _check(sizes, bucket)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=30), st.integers(1, 4096))
def test_property_every_byte_once_in_order(sizes, bucket):
    _check(sizes, bucket)


def _roundtrip(tensors, bucket):
    """Packs tensors into buckets by the plan and reassembles them: the receiver's work, in memory."""
    src = [as_bytes(t) for t in tensors]
    plan = plan_buckets([s.numel() for s in src], bucket)
    out = [torch.empty_like(s) for s in src]
    for b in plan:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        for s in b.slices:
            buf[s.dst:s.dst + s.length] = src[s.tensor][s.src:s.src + s.length]
        for s in b.slices:
            out[s.tensor][s.src:s.src + s.length] = buf[s.dst:s.dst + s.length]
    return [o.view(t.dtype).view(t.shape) for o, t in zip(out, tensors)]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("bucket", [1, 3, 7, 1024])
def test_every_dtype_survives_slicing(dtype, bucket):
    base = torch.randint(0, 255, (3 * 5 * 7 * 16,), dtype=torch.uint8)
    full = base[: 3 * 5 * 7 * torch.empty(0, dtype=dtype).element_size()].view(dtype).view(3, 5, 7)
    tensors = [full, full[:, 1:3, ::2], full[0, 0, 0], full[:0]]  # contiguous, strided, 0-dim, empty
    for got, want in zip(_roundtrip(tensors, bucket), tensors):
        assert got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
