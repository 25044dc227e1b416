"""The transfer checksum: deterministic, position-sensitive, alignment-proof."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.transfer.checksum import checksum_bytes, checksum_tensor


def test_same_bytes_same_checksum_any_alignment():
    data = torch.randint(0, 256, (50_001,), dtype=torch.uint8)
    padded = torch.cat([torch.zeros(3, dtype=torch.uint8), data])
    assert checksum_bytes(data) == checksum_bytes(padded[3:])


def test_detects_a_flipped_bit_anywhere_and_moved_bytes():
    data = torch.randint(0, 256, (3 * 8192 + 17,), dtype=torch.uint8)
    base = checksum_bytes(data)
    for at in (0, 7, 8191, 8192, 20000, data.numel() - 1):
        flipped = data.clone()
        flipped[at] ^= 1
        assert checksum_bytes(flipped) != base, at
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16].clone(), data[:8].clone()
    assert checksum_bytes(swapped) != base, "moving words must change the checksum"


def test_length_is_part_of_the_checksum():
    assert checksum_bytes(torch.zeros(8, dtype=torch.uint8)) != checksum_bytes(torch.zeros(16, dtype=torch.uint8))


def test_tensor_checksum_matches_its_bytes():
    t = torch.randn(33, 7).to(torch.bfloat16)
    assert checksum_tensor(t) == checksum_tensor(t.clone())
    assert checksum_tensor(t.t()) == checksum_tensor(t.t().contiguous())
    assert checksum_tensor(torch.tensor(3.0)) != checksum_tensor(torch.tensor(4.0))
    assert checksum_tensor(torch.empty(0)).startswith("0:")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=0, max_size=3),
       st.sampled_from([torch.bfloat16, torch.float32, torch.int8]), st.integers(1, 4), st.data())
def test_the_sums_of_any_cut_of_a_tensor_add_up_to_its_checksum(shape, dtype, parts, data):
    """box_sums: a tensor cut into boxes along any dimension (as ranks hold it) checksums as the whole."""
    from rlsync.transfer.checksum import box_sums, from_sums
    from rlsync.transfer.routes import chunks, whole

    t = (torch.randn(shape) * 100).to(dtype)
    boxes = [whole(shape)]
    if shape:
        dim = data.draw(st.integers(0, len(shape) - 1))
        boxes = [tuple((a, b) if d == dim else w for d, w in enumerate(whole(shape)))
                 for a, b in chunks(shape[dim], parts) if b > a]
    s1 = s2 = 0
    for box in boxes:
        a, b = box_sums(t[tuple(slice(x, y) for x, y in box)] if box else t, box, tuple(shape))
        s1, s2 = s1 + a, s2 + b
    assert from_sums(t.numel() * t.element_size(), s1, s2) == checksum_tensor(t)
