"""The staging check refuses an update whose second copy of the weights cannot fit, with a message
that says what to change, and lets one that fits through."""

from __future__ import annotations

import grpc
import pytest
import torch

from rlsync.errors import ResourceExhausted
from rlsync.rollout.staging import ensure_room, free_bytes


def test_update_that_does_not_fit_is_refused_with_what_to_change():
    cpu = torch.device("cpu")
    too_big = free_bytes(cpu) + (64 << 30)
    with pytest.raises(ResourceExhausted) as e:
        ensure_room(too_big, cpu, version=7)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(e.value)
    assert "staging version 7 needs" in message and "second copy of the weights" in message
    assert "gpu_memory_utilization" in message


def test_update_that_fits_passes():
    ensure_room(1 << 20, torch.device("cpu"), version=1)
