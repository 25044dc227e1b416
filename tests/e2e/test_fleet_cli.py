"""`rlsync up` as a person runs it: a fleet file, a local Ray started by the command, and the other
commands (status, scale, down) from other processes, which find the fleet by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("ray")

from rlsync.client import CoordinatorClient  # noqa: E402

pytestmark = pytest.mark.slow

FLEET = """
name: cli
coordinator: {port: 0}
rollout: [{engine: hf, replicas: 1, cpus: 0.5}]  # 2 CPUs: trainer 1, two replicas
"""


def rlsync(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsync.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_up_status_scale_down(tmp_path, tiny_model):
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(FLEET)
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "rlsync.cli", "up", str(fleet_file)], stdout=subprocess.PIPE,
                          stderr=log, text=True)
    try:
        printed: list[str] = []
        for line in iter(up.stdout.readline, ""):  # events while it starts, then one JSON line
            printed.append(line)
            if line.startswith("{"):
                break
        first = json.loads(printed[-1] if printed else "{}")
        assert first.get("event") == "up", "".join(printed) + (tmp_path / "up.log").read_text()[-3000:]
        assert any("rollout-0" in line and "listening" in line for line in printed)
        where = ["--name", "cli"]  # the other commands find the Ray that `up` started on this machine

        status = json.loads(rlsync("status", "--json", *where).stdout)
        assert [m["registered"] for m in status["members"] if m["role"] == "rollout"] == ["ready"]

        scaled = rlsync("scale", "rollout=2", *where)
        assert scaled.returncode == 0, scaled.stderr
        assert json.loads(scaled.stdout)["added"] == ["rollout-1"]
        refused = rlsync("scale", "decode=2", *where)
        assert refused.returncode == 2 and "no rollout group 'decode'" in refused.stderr

        with CoordinatorClient(first["coordinator"], timeout=60) as c:
            c.wait_ready(3)  # trainer and both replicas, the new one caught up
            result = c.sync_weights(verify=True)
        assert result.verified and dict(result.backends) == {"shm": 2}  # one node: one host

        printed = rlsync("status", *where).stdout
        assert "rollout-1" in printed and "ready" in printed

        down = rlsync("down", *where)
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0  # `up` sees its fleet taken down and ends
        events = up.stdout.read()
        assert "rollout-1" in events and "stopped" in events
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(60)
        log.close()


def test_a_bad_fleet_file_is_refused_before_anything_starts(tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("rollout: [{engine: sglang, replicas: 2}]\n")
    result = rlsync("up", str(bad))
    assert result.returncode == 2
    assert "$.rollout[0].engine" in result.stderr and "sglang" in result.stderr
    assert "Ray" not in result.stderr  # refused while reading the file, before any Ray started
