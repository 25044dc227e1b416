"""`docker compose up` for real: the image builds, the stack starts with two replicas, an RL step
syncs (verified) and both replicas serve; then it is taken down.

Needs a Docker engine. Where none answers but Debian's `dockerd` is installed and this runs as
root (machines like ours: `apt-get install docker.io`), the test starts one for itself and stops it
after. With no registry in reach, the image is built on a base made here from Debian's packages
(`make base-image`: debootstrap) and torch's CPU wheel from the host's cache (`make image-wheels`).
Skipped, with the reason, where none of that is possible."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlsync.client import CoordinatorClient, trajectory

ROOT = Path(__file__).resolve().parents[2]
LOCAL_BASE = "rlsync-base:bookworm"
PROJECT = "rlsync-test"
IMAGE = "rlsync:latest"  # docker-compose.yml's, for every service but SGLang's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args: str, timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)


def _engine() -> str | None:
    """Why no Docker engine can be used, or None when one answers."""
    try:
        out = _run("docker", "info", "--format", "{{.ServerVersion}}", timeout=20)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"no docker client or no answer: {e}"
    return None if out.returncode == 0 else f"no Docker engine answers `docker info`: {out.stderr.strip()[:200]}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A Docker engine: the one that answers, else dockerd started here (and stopped after)."""
    daemon = None
    if _engine() is not None and shutil.which("dockerd") and os.geteuid() == 0:
        log = open(tmp_path_factory.mktemp("dockerd") / "dockerd.log", "w")
        daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT)
        for _ in range(60):
            if _engine() is None or daemon.poll() is not None:
                break
            time.sleep(1)
    why = _engine()
    if why is not None:
        if daemon is not None:
            daemon.kill()
        pytest.skip(why if daemon is None else f"dockerd was started but does not answer: {why}")
    yield
    if daemon is not None:
        daemon.terminate()
        daemon.wait(60)


def _image_id(image: str) -> str:
    found = _run("docker", "image", "inspect", "-f", "{{.Id}}", image)
    return found.stdout.strip() if found.returncode == 0 else ""


def _compose_command() -> list[str] | None:
    """`docker compose` (v2), else `docker-compose` (v1, Debian's package)."""
    if _run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def _base_image() -> str:
    """The image to build on: RLSYNC_BASE_IMAGE, else python:3.11-slim when the engine has it or can
    pull it, else one made here from Debian's packages (made now when missing)."""
    if os.environ.get("RLSYNC_BASE_IMAGE"):
        return os.environ["RLSYNC_BASE_IMAGE"]
    for image in ("python:3.11-slim", LOCAL_BASE):
        if _run("docker", "image", "inspect", image).returncode == 0:
            return image
    if _run("docker", "pull", "python:3.11-slim", timeout=600).returncode == 0:
        return "python:3.11-slim"
    if not shutil.which("debootstrap"):
        pytest.skip("no registry reachable and no debootstrap to make a base image (apt-get install debootstrap)")
    subprocess.run(["make", "base-image"], cwd=ROOT, check=True, capture_output=True, timeout=1200)
    return LOCAL_BASE


@pytest.mark.docker
@pytest.mark.timeout(2400)  # a first build fetches the pinned set (about 4 GB installed)
def test_compose_builds_starts_scales_syncs_and_serves(engine):
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    port, http_port = free_port(), free_port()  # make test runs other tests beside this one
    env = {**os.environ, "RLSYNC_TOKEN": "", "RLSYNC_BASE_IMAGE": _base_image(), "RLSYNC_PORT": str(port),
           "RLSYNC_HTTP_PORT": str(http_port),
           "RLSYNC_VLLM_ARGS": '{"enforce_eager": true}'}  # as every vLLM replica of the suite: no compile

    def compose(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*command, "-p", PROJECT, *args], cwd=ROOT, check=True, text=True,
                              capture_output=True, timeout=timeout, env=env)

    subprocess.run(["make", "image-wheels"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    earlier = _image_id(IMAGE)  # an earlier run's image, which this build untags
    timings = {}
    start = time.monotonic()
    compose("build", "coordinator", "trainer", "rollout", timeout=3600)  # not the SGLang image (its profile)
    timings["build_s"] = time.monotonic() - start
    try:
        start = time.monotonic()
        compose("up", "-d", "--scale", "rollout=2")
        with CoordinatorClient(f"127.0.0.1:{port}") as fleet:
            fleet.wait_ready(3, timeout=900)  # a trainer and two replicas registered
            timings["up_s"] = time.monotonic() - start
            done = fleet.complete("numbers:", n=4, max_tokens=8, logprobs=True, seed=0)
            fleet.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
            start = time.monotonic()
            sync = fleet.sync_weights(verify=True)
            timings["sync_s"] = time.monotonic() - start
            assert sync.verified and sync.replicas == 2
            served = {fleet.complete("after", max_tokens=4, session_id=f"s{i}")[0].max_weight_version
                      for i in range(8)}
            assert served == {sync.version}
        print(json.dumps({"base_image": env["RLSYNC_BASE_IMAGE"], "compose": " ".join(command),
                          **{k: round(v, 1) for k, v in timings.items()}, "sync_verified": sync.verified,
                          "replicas": sync.replicas}))
    finally:
        start = time.monotonic()
        compose("down", "-v", timeout=300)
        # The earlier run's image goes: untagged, it would stay (images left so filled the CI machine's
        # disk once). Only the layers the new image does not share leave with it (rlsync's own, some
        # megabytes); the environment's stage is a layer of its own, cached for the next build (which
        # `docker image prune` would have removed with the untagged images).
        removed = ""
        if earlier and earlier != _image_id(IMAGE):
            try:
                removed = _run("docker", "rmi", earlier, timeout=300).stdout.strip()[-80:]
            except subprocess.TimeoutExpired as e:
                removed = f"not removed: {e}"
        print(json.dumps({"down_s": round(time.monotonic() - start, 1), "removed": removed}))
