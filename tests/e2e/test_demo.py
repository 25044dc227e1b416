"""The main job end to end: the same RL loop learns with weight sync and does not without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import NEEDS_SGLANG
from rlsync import preload

# each demo runs as long as its subprocess may (a loaded 2-core machine took the SGLang one past 300 s)
pytestmark = pytest.mark.timeout(900)


def run_demo(tmp_path, *args: str) -> dict:
    """The demo as a user runs it; its services are forked from the session's images where they may be (as
    the tests' own are: rlsync.preload), which it is told of (RLSYNC_PRELOADED)."""
    out = tmp_path / "run"
    images = preload.exported("base", args[args.index("--engine") + 1])
    proc = subprocess.run([sys.executable, "-m", "rlsync.demo.run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=880,
                          env={**os.environ, **({preload.ENV: images} if images else {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "reward.png").stat().st_size > 1000
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("mode, engine", [
    ("async", "vllm"), ("colocated", "hf"),
    pytest.param("inflight", "sglang", marks=[NEEDS_SGLANG, pytest.mark.sglang])])
def test_demo_learns_with_weight_sync(tmp_path, mode, engine):
    summary = run_demo(tmp_path, "--mode", mode, "--engine", engine, "--steps", "15")
    steps = summary["steps"]
    assert summary["mode"] == mode and len(steps) == 15
    assert [s["version"] for s in steps] == list(range(1, 16)), "each step's weights are served after its sync"
    assert all(s["weights_verified"] for s in steps), "engine checksums equal the trainer's after every sync"
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
    assert summary["reward_last5"] >= summary["reward_first5"] + 0.3, summary


def test_lora_demo_learns_syncing_only_the_adapter(tmp_path):
    """The tiny model's logits are bounded by its final norm, which LoRA on linear layers cannot
    scale: maximizing the digits' probability directly takes it from 0.244 to 0.297 at most (full
    training: to 1.0). So the LoRA run's reward rises by a few hundredths, measured over ten steps.
    On vLLM, the real engine (the hf engine's adapter syncs: tests/integration/test_lora_updates.py)."""
    summary = run_demo(tmp_path, "--engine", "vllm", "--lora", "--steps", "30")
    steps = summary["steps"]
    assert summary["lora_rank"] == 8 and [s["version"] for s in steps] == list(range(1, 31))
    assert all(s["weights_verified"] for s in steps), "base and adapter audited equal after every sync"
    rank, hidden, layers, inter = 8, 128, 2, 384  # the tiny model; all-linear: q k v o gate up down
    per_layer = rank * (hidden + hidden) + rank * (hidden + 64) * 2 + rank * (hidden + hidden) \
        + rank * (hidden + inter) * 3
    assert {s["sync_bytes"] for s in steps} == {4 * layers * per_layer}, "only the adapter's fp32 bytes move"
    first, last = (sum(s["reward_mean"] for s in part) / 10 for part in (steps[:10], steps[-10:]))
    assert last >= first + 0.015, (first, last, [round(s["reward_mean"], 3) for s in steps])


def test_demo_does_not_learn_without_weight_sync(tmp_path):
    """The control: the same loop with no sync (on the hf engine, the quickest to start)."""
    summary = run_demo(tmp_path, "--engine", "hf", "--steps", "15", "--no-sync")
    assert all(s["version"] == 0 for s in summary["steps"]), "the engine kept the initial weights"
    assert summary["reward_last5"] < summary["reward_first5"] + 0.1, summary
