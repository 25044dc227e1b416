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


def test_a_kept_audit_read_on_a_stream_of_its_own_sees_each_commits_bytes():
    """KeptAudit as a vLLM worker uses it (LiveAudit): laid out on the engine's stream, read on a stream of its own
    that waits for what was written before; at each call the bytes as they are then (its sums zeroed first)."""
    from rlsync.transfer.checksum import KeptAudit

    g = torch.Generator().manual_seed(7)
    weights = {f"w{k}": torch.randn(512, 384, generator=g).to(torch.bfloat16).cuda() for k in range(6)}
    weights["t"] = torch.randn(96, 64, generator=g).cuda().t()  # not contiguous: summed apart, anew each time
    kept = KeptAudit(weights, programs=4)
    side = torch.cuda.Stream()
    for step in range(3):
        for w in weights.values():
            w.add_(1.0)  # a commit's copy, on the engine's stream
        written = torch.cuda.Event()
        written.record()
        side.wait_event(written)
        with torch.cuda.stream(side):
            got = kept()
        assert got == {n: audit_entry(t) for n, t in weights.items()}, step
    assert kept.fits(weights) and not kept.fits({**weights, "w0": weights["w0"].clone()})
