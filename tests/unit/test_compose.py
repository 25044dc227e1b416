"""docker-compose.yml (no Docker engine runs here): services, commands, ports, scaling, and every
command's flags accepted by the real argument parser of the service it starts."""

from __future__ import annotations

import argparse
import importlib
import json
import re
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


RLSYNC = ("coordinator", "trainer", "rollout", "rollout-sglang")


def test_services_and_build(compose):
    assert set(compose["services"]) == {*RLSYNC, "prometheus", "grafana"}
    for name in RLSYNC:
        svc = compose["services"][name]
        sglang = name == "rollout-sglang"
        assert svc["build"]["context"] == "." and (ROOT / svc["build"].get("dockerfile", "Dockerfile")).exists()
        assert svc["build"]["args"]["BASE"] == "${RLSYNC_BASE_IMAGE:-python:3.11-slim}"
        assert svc["image"] == ("rlsync:sglang" if sglang else "rlsync:latest")
        assert svc.get("profiles") == (["sglang"] if sglang else None), "SGLang replicas only on request"


def test_the_sglang_image_installs_its_own_lock_and_the_cpu_kernel_placeholder():
    dockerfile = (ROOT / "deploy/sglang/Dockerfile").read_text()
    assert "requirements/sglang-lock.txt" in dockerfile and "deploy/sglang-cpu" in dockerfile
    assert (ROOT / "deploy/sglang-cpu/sgl_kernel/__init__.py").exists()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv-sglang" in ignored, "the build context leaves the local SGLang environment out"


def test_monitoring_profile_scrapes_every_service_into_the_dashboard(compose):
    from rlsync.common import metrics

    services = compose["services"]
    assert all(services[n]["profiles"] == ["monitoring"] for n in ("prometheus", "grafana"))
    assert all(services[n]["environment"]["RLSYNC_METRICS_PORT"] == "9100" for n in RLSYNC)
    for svc in ("prometheus", "grafana"):
        for volume in services[svc]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), volume
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"][0]["dns_sd_configs"][0]
    assert set(scrape["names"]) == set(RLSYNC) and scrape["port"] == 9100
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/rlsync.json").read_text())
    known = {m._name for m in vars(metrics).values() if hasattr(m, "_name")}
    used = {name for p in dashboard["panels"] for t in p["targets"]
            for name in re.findall(r"rlsync_[a-z_]+", t["expr"])}
    base = {re.sub(r"_(bucket|total|count|sum)$", "", n) for n in used}
    assert used and base <= known, f"the dashboard queries series no service exports: {base - known}"


@pytest.mark.parametrize("name", RLSYNC)
def test_command_is_a_real_cli_invocation(compose, name):
    command = compose["services"][name]["command"]
    service = name.split("-")[0]
    assert command[0] == service and service in COMMANDS
    module, cls = CONFIGS[service].split(":")
    parser = argparse.ArgumentParser()
    add_arguments(parser, getattr(importlib.import_module(module), cls))
    parser.parse_args(command[1:])  # exits on an unknown flag or bad value


def test_ports_and_scaling(compose):
    services = compose["services"]
    assert services["coordinator"]["ports"] == ["${RLSYNC_PORT:-50050}:50050", "${RLSYNC_HTTP_PORT:-8000}:8000"], \
        "clients reach the coordinator (on other host ports where the defaults are taken)"
    for rollout in (services["rollout"], services["rollout-sglang"]):
        assert "ports" not in rollout and "container_name" not in rollout, "--scale rollout=N needs no fixed host port"
    sglang = services["rollout-sglang"]["command"]
    assert sglang[sglang.index("--engine") + 1] == "sglang"
    for name in ("trainer", "rollout", "rollout-sglang"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--coordinator") + 1] == "coordinator:50050", "members find the coordinator by name"
        assert services[name]["depends_on"] == ["coordinator"]
    assert all(services[n]["environment"]["RLSYNC_HOST"] == "0.0.0.0" for n in RLSYNC), "reachable in the network"
