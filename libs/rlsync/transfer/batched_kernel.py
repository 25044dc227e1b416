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


@triton.jit
def cast_chunks(table, BLOCK: tl.constexpr):
    """Program i casts row i of `table` ([fp32 source address, bf16 destination address, elements];
    addresses multiples of 16 and 8 bytes, elements of 4). The rounding is torch's, in integers (ties
    to even; a NaN becomes 0x7FFF as on CUDA): bit for bit the trainer's own cast, and the same under
    Triton's interpreter, whose float casts truncate."""
    row = table + tl.program_id(0) * 3
    src = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(tl.uint32))
    dst = tl.multiple_of(tl.load(row + 1), 8).to(tl.pointer_type(tl.uint16))
    n = tl.multiple_of(tl.load(row + 2), 4)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        bits = tl.load(src + i, mask=inside)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        tl.store(dst + i, tl.where(nan, 0x7FFF, rounded).to(tl.uint16), mask=inside)
