"""The examples run end to end: a plain HF + PyTorch loop as the fleet's trainer; an agent loop over the
OpenAI API whose multi-turn trajectories feed training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import rollout_args
from rlsync.client import CoordinatorClient

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_plain_loop_publishes_every_step_and_generates_from_what_it_published(services):
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-example")
    services.start("rollout", rollout_args("hf", "--coordinator", co.address), name="rollout-example")
    with CoordinatorClient(co.address) as fleet:
        fleet.wait_ready(1)
    out = subprocess.run([sys.executable, str(EXAMPLES / "plain_publish.py"), "--coordinator", co.address,
                          "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [s["serving"] for s in steps] == [1, 2, 3, 4] and all(s["verified"] for s in steps)
    # Each step trains on completions made by the weights the previous step published.
    assert [s["generated_by_versions"] for s in steps] == [[0], [1], [2], [3]]


def test_agent_loop_over_the_openai_api_trains_on_its_multi_turn_trajectories(services):
    co = services.start("coordinator", ["--http-port", "0"], name="co-agent")
    services.start("trainer", ["--coordinator", co.address], name="trainer-agent")
    services.start("rollout", rollout_args("hf", "--coordinator", co.address), name="rollout-agent")
    with CoordinatorClient(co.address) as fleet:
        fleet.wait_ready(2)
    out = subprocess.run([sys.executable, str(EXAMPLES / "agent_openai.py"), "--coordinator", co.address,
                          "--http", co.http_address(), "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    # 2 tasks x 3 episodes x 2 turns per step, each assistant turn a trajectory; every sync verified.
    assert [(s["assistant_turns"], s["trained_on"]) for s in steps] == [(12, 12), (12, 12)]
    assert [s["synced_version"] for s in steps] == [1, 2] and all(s["verified"] for s in steps)
