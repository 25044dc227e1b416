"""`rlsync up` as the README runs it: the example fleet file, a local Ray started by the command, and
the other commands (status, scale, down) from other processes, which find the fleet by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from rlsync.client import CoordinatorClient  # noqa: E402

pytestmark = pytest.mark.slow

LOCAL = Path(__file__).parents[2] / "examples" / "fleets" / "local.yaml"


def rlsync(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsync.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_up_status_scale_down(tmp_path, tiny_model):
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "rlsync.cli", "up", str(LOCAL), "--timeout", "240"],
                          stdout=subprocess.PIPE, stderr=log, text=True)  # within pytest's 300 s: it says why
    try:
        printed: list[str] = []
        for line in iter(up.stdout.readline, ""):  # events while it starts, then one JSON line
            printed.append(line)
            if line.startswith("{"):
                break
        first = json.loads(printed[-1] if printed else "{}")
        assert first.get("event") == "up", "".join(printed) + (tmp_path / "up.log").read_text()[-3000:]
        assert any("rollout-0" in line and "listening" in line for line in printed)
        assert first["coordinator"].endswith(":50050")
        # No --address: the other commands find the Ray that `up` started on this machine.
        status = json.loads(rlsync("status", "--json").stdout)
        assert [m["registered"] for m in status["members"] if m["role"] == "rollout"] == ["ready", "ready"]
        with CoordinatorClient("127.0.0.1:50050", timeout=60) as c:
            result = c.sync_weights(verify=True)
            assert result.verified and dict(result.backends) == {"shm": 2}  # one node: one host

            scaled = rlsync("scale", "rollout=3")  # as the README does
            assert scaled.returncode == 0, scaled.stderr
            assert json.loads(scaled.stdout)["added"] == ["rollout-2"]
            c.wait_ready(4)  # the trainer and three replicas, the new one caught up
            assert c.sync_weights(verify=True).replicas == 3

            scaled = rlsync("scale", "rollout=1")
            assert scaled.returncode == 0, scaled.stderr
            assert json.loads(scaled.stdout)["removed"] == ["rollout-2", "rollout-1"]  # newest first
            refused = rlsync("scale", "decode=2")
            assert refused.returncode == 2 and "no rollout group 'decode'" in refused.stderr
            assert c.sync_weights(verify=True).replicas == 1

        printed = rlsync("status").stdout
        assert "rollout-0" in printed and "rollout-1" not in printed

        down = rlsync("down")
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0  # `up` sees its fleet taken down and ends
        events = up.stdout.read()
        assert "rollout-1" in events and "stopped" in events and "scaled" in events
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
        log.close()


def test_a_bad_fleet_file_is_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("rollout: [{engine: tgi, replicas: 2}]\n")
    result = rlsync("up", str(bad))
    assert result.returncode == 2
    assert "$.rollout[0].engine" in result.stderr and "tgi" in result.stderr
    assert "Ray" not in result.stderr  # refused while reading the file, before any Ray started
