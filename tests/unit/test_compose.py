"""docker-compose.yml (no Docker engine runs here): services, commands, ports, scaling, and every
command's flags accepted by the real argument parser of the service it starts."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest
import yaml

from rlsync.cli import COMMANDS
from rlsync.config import add_arguments

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"coordinator": "rlsync.coordinator.config:CoordinatorConfig",
           "trainer": "rlsync.trainer.config:TrainerConfig", "rollout": "rlsync.rollout.config:RolloutConfig"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_build(compose):
    assert set(compose["services"]) == {"coordinator", "trainer", "rollout"}
    assert (ROOT / "Dockerfile").exists()
    for svc in compose["services"].values():
        assert svc["build"] == "." and svc["image"] == "rlsync:latest"


@pytest.mark.parametrize("name", ["coordinator", "trainer", "rollout"])
def test_command_is_a_real_cli_invocation(compose, name):
    command = compose["services"][name]["command"]
    assert command[0] == name and name in COMMANDS
    module, cls = CONFIGS[name].split(":")
    parser = argparse.ArgumentParser()
    add_arguments(parser, getattr(importlib.import_module(module), cls))
    parser.parse_args(command[1:])  # exits on an unknown flag or bad value


def test_ports_and_scaling(compose):
    services = compose["services"]
    assert services["coordinator"]["ports"] == ["50050:50050", "8000:8000"], "clients reach the coordinator"
    rollout = services["rollout"]
    assert "ports" not in rollout and "container_name" not in rollout, "--scale rollout=N needs no fixed host port"
    for name in ("trainer", "rollout"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--coordinator") + 1] == "coordinator:50050", "members find the coordinator by name"
        assert services[name]["depends_on"] == ["coordinator"]
    assert all(s["environment"]["RLSYNC_HOST"] == "0.0.0.0" for s in services.values()), "reachable in the network"
