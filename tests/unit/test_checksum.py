"""The transfer checksum: deterministic, position-sensitive, alignment-proof."""

import torch

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
