"""A content checksum computed the same way on CPU and GPU, from torch ops only.

Position-weighted (it catches bytes moved to the wrong offset, not just changed ones): with the
bytes read as little-endian 64-bit words w_i (zero-padded), it is (sum w_i, sum (i+1) w_i) modulo
2^64. The weighted sum is computed from row and column sums of a [rows, 1024] view, so no index
tensor as large as the data is ever built.
"""

from __future__ import annotations

import torch

_COLS = 1024
_MASK = (1 << 64) - 1


def _sums(words: torch.Tensor, base: int) -> tuple[int, int]:
    """(sum w, sum (base+i+1) w) mod 2^64 for int64 words laid out as [rows, _COLS]."""
    rows = words.view(-1, _COLS)
    row_sums = rows.sum(dim=1)
    col_sums = rows.sum(dim=0)
    r = torch.arange(rows.shape[0], device=words.device, dtype=torch.int64)
    c = torch.arange(1, _COLS + 1, device=words.device, dtype=torch.int64)
    s1 = int(row_sums.sum())
    s2 = int((row_sums * r).sum()) * _COLS + int((col_sums * c).sum()) + base * s1
    return s1 & _MASK, s2 & _MASK


def checksum_bytes(data: torch.Tensor) -> str:
    """Checksum of a 1-D uint8 tensor (any device), as 'nbytes:s1:s2' in hex."""
    data = data.reshape(-1)
    if data.storage_offset() % 8:
        data = data.clone()  # an int64 view needs 8-byte alignment
    n = data.numel()
    block = 8 * _COLS
    main = n - n % block
    s1 = s2 = 0
    if main:
        a, b = _sums(data[:main].view(torch.int64), 0)
        s1, s2 = a, b
    if main < n:
        tail = torch.zeros(block, dtype=torch.uint8, device=data.device)
        tail[: n - main] = data[main:]
        a, b = _sums(tail.view(torch.int64), main // 8)
        s1, s2 = (s1 + a) & _MASK, (s2 + b) & _MASK
    return f"{n:x}:{s1:016x}:{s2:016x}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a copy only when `t` is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def checksum_tensor(t: torch.Tensor) -> str:
    return checksum_bytes(as_bytes(t))


def audit_entry(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """(dtype, shape, checksum) of one tensor: a row of a weight audit (rlsync.common.audit)."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), checksum_tensor(t)
