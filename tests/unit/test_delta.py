"""Delta encoding (rlsync.transfer.delta): any change to any bytes rebuilds bit for bit, and a
delta is only produced when it is smaller than the bytes it replaces."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync.transfer import delta


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 3000), changes=st.lists(st.integers(0, 10 ** 6), max_size=400),
       seed=st.integers(0, 2 ** 16))
def test_a_delta_rebuilds_the_new_bytes_exactly(words, changes, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (2 * words,), dtype=torch.uint8, generator=g)
    new = base.clone()
    for c in changes:
        new[c % new.numel()] = (int(new[c % new.numel()]) + 1 + c) % 256
    payload = delta.encode(new, base)
    changed = int((new.view(torch.int16) != base.view(torch.int16)).sum())
    if payload is None:
        assert delta.payload_bytes(changed) >= new.numel()
        return
    assert payload.numel() == delta.payload_bytes(changed) < new.numel()
    out = base.clone()
    delta.apply(payload, out)
    assert torch.equal(out, new)


def test_buffers_that_cannot_be_compared_word_by_word_go_whole():
    odd = torch.zeros(7, dtype=torch.uint8)
    assert delta.encode(odd, odd.clone()) is None
    unaligned = torch.zeros(9, dtype=torch.uint8)[1:]
    assert delta.encode(unaligned, torch.zeros(8, dtype=torch.uint8)) is None
    assert delta.encode(torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)).numel() == 0
