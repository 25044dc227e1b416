"""The bring-your-own-trainer example runs end to end: a plain HF + PyTorch loop is the fleet's trainer."""

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
