"""Checksums of many tensors in one launch on the GPU (rlsync.transfer.checksum.checksum_tensors) equal
each tensor's own, and equal what the CPU computes for the same bytes: an audit read back from an
engine's live weights is compared with the trainer's."""

from __future__ import annotations

import pytest
import torch

from rlsync.transfer.checksum import audit, audit_entry, checksum_tensor, checksum_tensors

pytestmark = pytest.mark.gpu


def test_one_launch_equals_one_tensor_at_a_time_and_the_cpu():
    g = torch.Generator().manual_seed(5)
    cpu = [torch.randn(2048, 1024, generator=g).to(torch.bfloat16), torch.randn(151, 77, generator=g),
           torch.randint(-2 ** 62, 2 ** 62, (300_001,), dtype=torch.int64, generator=g), torch.randn(7, generator=g),
           torch.randn(64, 96, generator=g).t(), torch.empty(0)]
    gpu = [t.cuda() for t in cpu]
    gpu.append(gpu[0].view(-1)[1:4097])  # bytes starting off an 8-byte boundary: the torch path
    cpu.append(cpu[0].view(-1)[1:4097])
    got = checksum_tensors(gpu)
    assert got == [checksum_tensor(t) for t in gpu] == [checksum_tensor(t) for t in cpu]
    named = {f"w{k}": t for k, t in enumerate(gpu)}
    assert audit(named) == {n: audit_entry(t) for n, t in named.items()}
    flipped = gpu[2].clone()
    flipped[123_456] ^= 1 << 40
    assert checksum_tensors([flipped])[0] != got[2]
