"""The Triton kernels of rlsync.transfer.batched and of checksum_tensors (imported at first use: Triton is optional)."""

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


@triton.jit
def checksum_chunks(table, rows, sums, BLOCK: tl.constexpr):
    """Program p adds rows p, p + P, p + 2P... (P programs) of `table` ([address, words, tensor, first word],
    int64; the address a multiple of 8) to their tensors' sums: sums[2 t] += sum w_j, sums[2 t + 1] +=
    sum (first + j + 1) w_j over the chunk's little-endian 64-bit words w_j, in int64 arithmetic, which
    wraps: modulo 2^64, so the chunks add up in any order (rlsync.transfer.checksum)."""
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = table + r * 4
        src = tl.multiple_of(tl.load(row), 8).to(tl.pointer_type(tl.int64))
        words = tl.load(row + 1)
        tensor = tl.load(row + 2)
        first = tl.load(row + 3)
        s1 = tl.zeros((BLOCK,), dtype=tl.int64)
        s2 = tl.zeros((BLOCK,), dtype=tl.int64)
        for start in range(0, words, BLOCK):
            j = start + tl.arange(0, BLOCK)
            w = tl.load(src + j, mask=j < words, other=0)
            s1 += w
            s2 += (first + j + 1) * w
        tl.atomic_add(sums + 2 * tensor, tl.sum(s1, axis=0))
        tl.atomic_add(sums + 2 * tensor + 1, tl.sum(s2, axis=0))
