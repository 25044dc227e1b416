"""Start-up errors a new user meets (issue 29): each is one line on stderr, `rlsync <command>: error: ...`,
exit status 2 and no traceback, naming the path, port or flag (and its RLSYNC_* variable) to change.
Every case is refused before anything loads or listens (nothing on stdout), so each takes a second or two."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from rlsync.config import ServerConfig
from rlsync.checks import StartupError
from rlsync.rpc.server import run_service


def _env(**extra: str) -> dict[str, str]:
    """This environment without the RLSYNC_* settings a developer's shell may carry (the cache stays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSYNC_") or k == "RLSYNC_CACHE"}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def run(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env or _env())


def refused(argv: list[str], env: dict[str, str] | None = None, module: str | None = None) -> str:
    """Runs `rlsync ARGV` (or `python -m MODULE ARGV`) and returns its one line of refusal."""
    command = [sys.executable, "-m", module, *argv] if module else [sys.executable, "-m", "rlsync.cli", *argv]
    out = run(command, env)
    said = f"rc={out.returncode}\nstdout:\n{out.stdout[-2000:]}\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 2, said
    assert "Traceback" not in out.stderr, said
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, said
    prog = f"rlsync {module.rpartition('.')[2] if module else argv[0]}"
    assert lines[0].startswith(f"{prog}: error: "), said
    assert out.stdout == "", "refused before it listens: " + said
    return lines[0]


@pytest.fixture
def taken_port():
    """A port some other process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# ---- the model --------------------------------------------------------------------------------

def test_model_path_that_does_not_exist():
    line = refused(["rollout", "--model", "/nonexistent/path"])
    assert "/nonexistent/path does not exist" in line and "--model" in line, line
    assert "Repo id" not in line


def test_model_name_not_in_the_local_cache_is_not_downloaded(tmp_path):
    line = refused(["rollout", "--engine", "hf", "--model", "some-org/not-downloaded"],
                   _env(HF_HUB_CACHE=str(tmp_path)))
    assert "some-org/not-downloaded" in line and "nothing is downloaded at run time" in line, line
    assert str(tmp_path) in line and "hf download some-org/not-downloaded" in line, line


@pytest.mark.parametrize("kind, fragment", [("folder", "has no config.json"), ("file", "is a file")])
def test_model_that_is_not_a_model_folder(tmp_path, kind, fragment):
    model = tmp_path
    if kind == "file":
        model = tmp_path / "model.safetensors"
        model.write_bytes(b"0")
    line = refused(["trainer", "--model", str(model)])
    assert f"{model} {fragment}" in line and "--model (RLSYNC_MODEL)" in line, line


def test_trainer_model_relative_path():
    line = refused(["trainer", "--model", "./no-such-model-folder"])
    assert "./no-such-model-folder does not exist" in line, line


# ---- ports and addresses ----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["coordinator", "rollout", "trainer"])
def test_port_in_use_names_the_port_and_the_flag(taken_port, command):
    line = refused([command, "--port", str(taken_port)])
    assert f"port {taken_port} on 127.0.0.1 is already in use" in line, line
    assert "--port (RLSYNC_PORT)" in line, line


def test_port_in_use_from_the_environment_with_python_m(taken_port):
    line = refused([], _env(RLSYNC_PORT=str(taken_port)), module="rlsync.trainer")
    assert f"port {taken_port}" in line and "RLSYNC_PORT" in line, line


@pytest.mark.parametrize("flag, variable", [("--metrics-port", "RLSYNC_METRICS_PORT"),
                                            ("--http-port", "RLSYNC_HTTP_PORT")])
def test_http_ports_in_use(taken_port, flag, variable):
    line = refused(["coordinator", "--port", "0", flag, str(taken_port)])
    assert f"port {taken_port}" in line and f"{flag} ({variable})" in line, line


@pytest.mark.parametrize("argv, fragments", [
    (["coordinator", "--port", "70000"], ["--port (RLSYNC_PORT)", "at most 65535", "70000"]),
    (["coordinator", "--port", "0", "--metrics-port", "-2"], ["--metrics-port", "at least -1"]),
    (["coordinator", "--port", "50999", "--http-port", "50999"], ["--http-port", "--port", "50999"]),
    (["coordinator", "--port", "0", "--host", "192.0.2.1"], ["--host (RLSYNC_HOST)", "'192.0.2.1'",
                                                             "not an address of this host"]),
    (["coordinator", "--port", "0", "--host", "nohost.invalid"], ["--host", "not an address of this host"]),
    (["coordinator", "--port", "0", "--trainer", "trainer-without-port"], ["--trainer (RLSYNC_TRAINER)",
                                                                           "not host:port"]),
    (["coordinator", "--port", "0", "--rollouts", "127.0.0.1:50051,r2"], ["--rollouts", "'r2'"]),
    (["rollout", "--port", "0", "--coordinator", "http://127.0.0.1:50050"], ["--coordinator", "without a scheme"]),
    (["trainer", "--port", "0", "--coordinator", "127.0.0.1:port"], ["--coordinator", "'port' is not a port"]),
    (["rollout", "--port", "0", "--advertise", "::1:50051"], ["--advertise", "brackets"]),
])
def test_ports_and_addresses(argv, fragments):
    line = refused(argv)
    for fragment in fragments:
        assert fragment in line, line


def test_port_taken_after_the_check_is_refused_the_same_way(taken_port):
    """The check at start-up and the bind race (another process takes the port meanwhile): the bind
    itself is refused in the same words, and the service still closes what it started."""
    closed = []

    class Service:
        name, service_names = "probe", []

        def add_to_server(self, server):
            pass

        async def start(self):
            pass

        async def serving(self, host, port):
            pass

        async def drain(self, reason):
            pass

        async def close(self):
            closed.append(True)

    for cfg, flag in ((ServerConfig(port=taken_port), "--port"), (ServerConfig(metrics_port=taken_port),
                                                                   "--metrics-port")):
        with pytest.raises(StartupError, match=f"port {taken_port} on 127.0.0.1 is already in use.*{flag}"):
            asyncio.run(run_service(cfg, Service()))
        assert closed.pop()


# ---- TLS --------------------------------------------------------------------------------------

def test_tls_files(tmp_path):
    line = refused(["coordinator", "--port", "0", "--tls-cert", str(tmp_path / "cert.pem")])
    assert "give --tls-key (RLSYNC_TLS_KEY) too" in line, line
    line = refused(["coordinator", "--port", "0", "--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/x.key"])
    assert "--tls-cert (RLSYNC_TLS_CERT): /nonexistent/cert.pem does not exist" in line, line
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    line = refused(["coordinator", "--port", "0", "--tls-cert", str(tmp_path / "cert.pem"),
                    "--tls-key", str(tmp_path / "key.pem")])
    assert "do not load as an unencrypted PEM certificate and its private key" in line, line


# ---- values out of range, names that are not known ---------------------------------------------

@pytest.mark.parametrize("argv, env, fragments", [
    (["coordinator", "--lease", "-1"], {}, ["--lease (RLSYNC_LEASE)", "more than 0", "-1"]),
    (["coordinator", "--lease", "0.5"], {}, ["--lease", "longer than --heartbeat-interval"]),
    (["coordinator", "--heartbeat-interval", "0"], {}, ["--heartbeat-interval", "more than 0"]),
    (["coordinator", "--update-timeout", "-5"], {}, ["--update-timeout", "more than 0"]),
    (["coordinator", "--max-resubmissions", "-1"], {}, ["--max-resubmissions", "at least 0"]),
    (["coordinator", "--grace-seconds", "-1"], {}, ["--grace-seconds", "at least 0"]),
    (["coordinator", "--max-message-bytes", "0"], {}, ["--max-message-bytes", "at least 1"]),
    (["coordinator", "--lease", "nan"], {}, ["--lease", "nan"]),
    (["coordinator", "--force-backend", "rdma"], {}, ["--force-backend", "unknown backend 'rdma'", "shm"]),
    (["coordinator"], {"RLSYNC_PORT": "many"}, ["RLSYNC_PORT", "'many'", "an integer"]),
    (["coordinator"], {"RLSYNC_DOORBELL": "maybe"}, ["RLSYNC_DOORBELL", "true or false"]),
    (["coordinator"], {"RLSYNC_SYNC_MODE": "sideways"}, ["RLSYNC_SYNC_MODE", "invalid choice: 'sideways'"]),
    (["rollout", "--coordinator-lease", "-1"], {}, ["--coordinator-lease", "at least 0"]),
    (["rollout", "--update-timeout", "0"], {}, ["--update-timeout (RLSYNC_UPDATE_TIMEOUT)", "more than 0"]),
    (["rollout"], {"RLSYNC_ENGINE": "tgi"}, ["RLSYNC_ENGINE", "invalid choice: 'tgi'", "vllm"]),
    (["rollout", "--engine-args", "[1, 2]"], {}, ["--engine-args", "JSON object"]),
    (["rollout", "--engine-args", "{bad"], {}, ["--engine-args", "JSON object"]),
    (["rollout", "-E", "no-equals-sign"], {}, ["-E/--engine-arg", "KEY=VALUE", "'no-equals-sign'"]),
    (["rollout", "--engine", "hf", "-E", "dtype=bogus"], {}, ["hf engine argument dtype='bogus'", "float32"]),
    (["rollout", "--engine", "hf", "-E", "device=gpu"], {}, ["hf engine argument device='gpu'", "cuda:N"]),
    (["trainer", "--nproc", "0"], {}, ["--nproc (RLSYNC_NPROC)", "at least 1"]),
    (["trainer", "--micro-batch", "0"], {}, ["--micro-batch", "at least 1"]),
    (["trainer", "--lr", "-0.1"], {}, ["--lr", "at least 0"]),
    (["trainer", "--bucket-bytes", "0"], {}, ["--bucket-bytes", "at least 1"]),
    (["trainer", "--lora-rank", "-1"], {}, ["--lora-rank", "at least 0"]),
    (["trainer", "--lora-rank", "8", "--lora-targets", ","], {}, ["--lora-targets", "names no module"]),
    (["trainer", "--transfer-timeout", "0"], {}, ["--transfer-timeout", "more than 0"]),
    (["trainer", "--publish-buffer", "--device", "cpu"], {}, ["--publish-buffer", "one CUDA process", "CPU --device"]),
    (["trainer", "--device", "gpu"], {}, ["--device (RLSYNC_DEVICE)", "'gpu' is not a training device"]),
    (["trainer", "--device", "cuda:99"], {}, ["--device", "'cuda:99'"]),
    (["trainer"], {"RLSYNC_DTYPE": "float64"}, ["RLSYNC_DTYPE", "invalid choice: 'float64'"]),
])
def test_values(argv, env, fragments):
    port = [] if "RLSYNC_PORT" in env else ["--port", "0"]  # not a default port another test may hold
    line = refused([*argv, *port], _env(**env))
    for fragment in fragments:
        assert fragment in line, line


def test_spool_dir_that_is_a_file(tmp_path):
    (tmp_path / "spool").write_text("")
    line = refused(["trainer", "--port", "0", "--spool-dir", str(tmp_path / "spool")])
    assert f"--spool-dir (RLSYNC_SPOOL_DIR): {tmp_path / 'spool'} is not a folder" in line, line


# ---- argparse's own refusals: its usage, then the one line --------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["up", "--timeout", "0", "fleet.yaml"], "rlsync up: error: argument --timeout: must be more than 0"),
    (["logs", "rollout-1", "-n", "0"], "rlsync logs: error: argument -n/--lines: must be at least 1"),
    (["rollout", "--engine", "tgi"], "rlsync rollout: error: argument --engine: invalid choice: 'tgi'"),
    (["nonsense"], "rlsync: error: unknown command 'nonsense'"),
    (["demo", "--model", "/nonexistent"], "rlsync demo: error: argument --model: /nonexistent does not exist"),
    (["demo", "--replicas", "0"], "rlsync demo: error: --replicas and --steps take 1 or more"),
    (["transfer-check", "/missing.safetensors", "--backend", "shm"],
     "rlsync transfer-check: error: /missing.safetensors: no such file"),
    (["transfer-check", __file__, "--backend", "shm"],
     "rlsync transfer-check: error: " + __file__ + ": not a readable"),
])
def test_argparse_refusals(argv, fragment):
    out = run([sys.executable, "-m", "rlsync.cli", *argv])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith(fragment), out.stderr[-3000:]


def test_fleet_file_that_does_not_exist():
    line = refused(["up", "/nonexistent/fleet.yaml"])
    assert "cannot read the fleet file /nonexistent/fleet.yaml" in line, line


@pytest.mark.skipif(__import__("rlsync.rollout.engines.fp8_support", fromlist=["x"]).cpu_has_amx(),
                    reason="this CPU has AMX: vLLM's CPU build may serve FP8 here")
def test_vllm_on_a_cpu_without_amx_refuses_an_fp8_model_saying_why():
    from rlsync.models import ensure_tiny_fp8

    line = refused(["rollout", "--port", "0", "--engine", "vllm", "--model", str(ensure_tiny_fp8())])
    assert "vllm cannot serve the FP8 model" in line and "AMX" in line and "--engine hf" in line
