"""Delta updates: a bucket sent as only the 16-bit words that changed since the receiver's base.

A bucket's bytes are compared with the same bytes of the version every receiver already holds, as
16-bit words (a bf16 or fp16 value is one word; an fp32 value two, of which an RL step often
changes only one). The delta is the changed positions (int32) then their new words (int16):
6 bytes per changed word, so it is sent only when smaller than the bucket (fewer than a third of
the words changed); otherwise the bucket goes whole. Pure tensor functions: the channels
(backends/collective.py) move the payloads, and verify the rebuilt bucket bit for bit.
"""

from __future__ import annotations

import torch

WORD = 2  # bytes per compared word
_POS = 4  # bytes per position (int32)


def eligible(new: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether two byte buffers can be compared word by word (even size, 2-byte aligned, < 2^31 words)."""
    return (new.numel() == base.numel() and new.numel() % WORD == 0 and new.numel() // WORD < 2 ** 31
            and new.data_ptr() % WORD == 0 and base.data_ptr() % WORD == 0)


def encode(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
    """The delta turning `base` into `new` (1-D uint8 buffers of one size, on one device), as one
    uint8 buffer, or None when the whole bucket is no bigger (or the buffers cannot be compared).
    Reads the number of changed words back to the host: one synchronization per bucket."""
    if not eligible(new, base):
        return None
    words, old = new.view(torch.int16), base.view(torch.int16)
    changed = (words != old).nonzero().flatten()  # nonzero synchronizes: its size is data-dependent
    if changed.numel() * (_POS + WORD) >= new.numel():
        return None
    positions = changed.to(torch.int32)
    return torch.cat([positions.view(torch.uint8), words[changed].view(torch.uint8)])


def payload_bytes(changed_words: int) -> int:
    return changed_words * (_POS + WORD)


def apply(payload: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the new words of a delta into `out` (a 1-D uint8 buffer holding the base bytes)."""
    if payload.numel() % (_POS + WORD):
        raise ValueError(f"a delta payload of {payload.numel()} bytes is not a whole number of changes")
    n = payload.numel() // (_POS + WORD)
    positions = payload[:n * _POS].view(torch.int32).long()
    out.view(torch.int16)[positions] = payload[n * _POS:].view(torch.int16)
