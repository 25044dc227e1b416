"""The main job end to end: the same RL loop learns with weight sync and does not without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_demo(tmp_path, *args: str) -> dict:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rlsync.demo.run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "reward.png").stat().st_size > 1000
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("mode, engine", [("async", "vllm"), ("colocated", "hf")])
def test_demo_learns_with_weight_sync(tmp_path, mode, engine):
    summary = run_demo(tmp_path, "--mode", mode, "--engine", engine, "--steps", "15")
    steps = summary["steps"]
    assert summary["mode"] == mode and len(steps) == 15
    assert [s["version"] for s in steps] == list(range(1, 16)), "each step's weights are served after its sync"
    assert all(s["weights_verified"] for s in steps), "engine checksums equal the trainer's after every sync"
    assert all(0.0 <= s["reward_mean"] <= 1.0 for s in steps)
    assert summary["reward_last5"] >= summary["reward_first5"] + 0.3, summary


def test_demo_does_not_learn_without_weight_sync(tmp_path):
    summary = run_demo(tmp_path, "--engine", "vllm", "--steps", "15", "--no-sync")
    assert all(s["version"] == 0 for s in summary["steps"]), "the engine kept the initial weights"
    assert summary["reward_last5"] < summary["reward_first5"] + 0.1, summary
