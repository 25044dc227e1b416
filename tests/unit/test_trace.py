"""RLSYNC_TRACE_DIR: transfer ends write PyTorch profiler traces, one at a time per process (the
profiler allows one session: two ends overlapping in one process, a sender's and a receiver's
thread here, must not both open one)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

from rlsync.flat import FlatStore
from rlsync.transfer import WeightSender, answer, receive

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from transfer_trace import summary  # noqa: E402


def test_overlapping_transfer_ends_trace_one_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSYNC_TRACE_DIR", str(tmp_path))
    source = FlatStore({"w": (torch.Size((64, 8)), torch.float32)}).views
    source["w"].normal_()
    sender = WeightSender(source, bucket_bytes=1 << 10, backends=["gloo"])
    try:
        for version in (1, 2):
            offer = sender.offer(version)
            ans, dest = answer(offer, "r", force="gloo"), {"w": torch.zeros(64, 8)}
            received = threading.Thread(target=receive, args=(offer, ans, dest), kwargs={"timeout": 30})
            received.start()
            sender.send(offer, [ans], timeout=30)
            received.join()
            assert torch.equal(dest["w"], source["w"])
    finally:
        sender.close()
    traces = sorted(tmp_path.glob("*.json"))
    assert 2 <= len(traces) <= 4, traces  # each transfer: its sender, or its receiver, or both in turn
    for path in traces:
        assert path.name.split("-")[0] in ("send", "receive")
        assert json.loads(path.read_text())["traceEvents"]
        assert summary(path)["transfer_kernels"] == 0  # no GPU here: nothing on one
