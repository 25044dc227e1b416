"""The Triton kernel of rlsync.transfer.batched (imported at its first use: Triton is optional)."""

import triton
import triton.language as tl


@triton.jit
def copy_chunks(table, BLOCK: tl.constexpr):
    """Program i copies row i of `table` ([src address, dst address, bytes], int64; addresses and
    bytes multiples of 16) in steps of BLOCK 16-byte pairs of words: each pair one 16-byte access
    (bench/copy_kernels.py: 0.94x of one flat copy; one word at a time, 0.87x)."""
    row = table + tl.program_id(0) * 3
    src = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(tl.int64))
    dst = tl.multiple_of(tl.load(row + 1), 16).to(tl.pointer_type(tl.int64))
    pairs = tl.load(row + 2) // 16
    for start in range(0, pairs, BLOCK):
        i = start + tl.arange(0, BLOCK)
        at = i[:, None] * 2 + tl.arange(0, 2)[None, :]
        inside = (i < pairs)[:, None]
        tl.store(dst + at, tl.load(src + at, mask=inside), mask=inside)
