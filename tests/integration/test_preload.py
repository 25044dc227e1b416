"""Services forked from the tests' preloaded process (rlsync.preload) behave as processes of their own:
they listen, take their log, exit statuses and signals as a Popen reports them, and a service the
preloaded image does not suit gets a process of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import NEEDS_SGLANG, rollout_args
from rlsync.client import RolloutClient
from rlsync.launch import sglang_python
from rlsync.preload import ENV, Forked, eligible, exported, preloaded_for


@pytest.mark.parametrize("service, args, expected", [
    ("coordinator", [], "base"),
    ("trainer", ["--steps", "1"], "base"),
    ("rollout", ["--engine", "hf"], "base"),
    ("rollout", ["--engine", "vllm"], "vllm"),  # an image that imported vLLM too
    ("rollout", ["--engine", "sglang"], "sglang"),  # an image in SGLang's environment
    ("rollout", [], None),  # the default engine (vLLM, or RLSYNC_ENGINE's): not told
    ("rollout", ["--engine"], None),
])
def test_which_services_the_preloaded_image_suits(service, args, expected):
    assert eligible(service, args) == expected


def test_a_forked_replica_serves_and_reports_its_exit_as_popen_would(services, preloaded):
    if preloaded is None:
        pytest.skip("RLSYNC_TEST_PRELOAD=0")
    replica = services.start("rollout", rollout_args("hf"), name="forked")
    assert isinstance(replica.proc, Forked)
    assert psutil.Process(replica.proc.pid).ppid() == preloaded.proc.pid
    assert os.getpgid(replica.proc.pid) == replica.proc.pid  # a process group of its own, as Popen's
    (done,) = RolloutClient(replica.address).complete("3+4=", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
    assert replica.proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        replica.proc.wait(0.1)
    assert replica.stop() == 0, replica.log_tail()  # SIGTERM: a graceful exit
    assert "listening" in replica.log_path.read_text()

    killed = services.start("coordinator", [], name="forked-killed")
    killed.proc.send_signal(signal.SIGKILL)
    assert killed.proc.wait(30) == -signal.SIGKILL

    # a script that runs the service itself, with a fault to inject as it starts (no module of the image reads it)
    scripted = services.start("rollout", rollout_args("hf"), env={"RLSYNC_FAULT": "die_in_prepare:0"},
                              script=Path(__file__).parents[1] / "rollout_worker.py", name="forked-script")
    assert isinstance(scripted.proc, Forked) and psutil.Process(scripted.proc.pid).ppid() == preloaded.proc.pid
    assert scripted.stop() == 0, scripted.log_tail()


def test_a_service_given_other_environment_gets_a_process_of_its_own(services, preloaded):
    proc = services.start("coordinator", [], env={"RLSYNC_LOG_LEVEL": "DEBUG"}, name="own-process")
    assert isinstance(proc.proc, subprocess.Popen)
    assert proc.stop() == 0


def test_a_vllm_replica_is_forked_from_an_image_that_imported_vllm_too(preloaded):
    if preloaded is None:
        pytest.skip("RLSYNC_TEST_PRELOAD=0")
    image = preloaded_for("rollout", ["--engine", "vllm"], dict(os.environ), None, 0)
    assert image is not None and image.image == "vllm" and image is not preloaded
    assert image.proc.poll() is None
    assert preloaded_for("rollout", ["--engine", "vllm"], dict(os.environ), None, 0) is image, "made once"
    bound = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a tensor-parallel replica's: read at start
    assert preloaded_for("rollout", ["--engine", "vllm"], bound, None, 0) is image
    assert preloaded_for("rollout", ["--engine", "vllm"], {**os.environ, "RLSYNC_LOG_LEVEL": "DEBUG"}, None, 0) is None
    assert preloaded_for("rollout", ["--engine", "hf"], bound, None, 0) is None, "the base image imports no vLLM"


# A process the tests start that starts services itself (as the demo does), told the session's images.
STARTS_A_COORDINATOR = """
import json, os, sys
import psutil
from rlsync.launch import ServiceProcess
from rlsync.preload import Forked
import torch._inductor.config  # sets its cache folder in the environment, as the image's imports did
proc = ServiceProcess("coordinator", ["--port", "0"], log_path=sys.argv[1], env=json.loads(sys.argv[2]))
proc.wait_ready()
forked = isinstance(proc.proc, Forked)
parent = psutil.Process(proc.proc.pid).ppid()
print(json.dumps({"forked": forked, "parent": parent, "exit": proc.stop()}))
"""


def test_a_process_started_with_the_sessions_images_forks_its_services_from_them(tmp_path, preloaded):
    if preloaded is None:
        pytest.skip("RLSYNC_TEST_PRELOAD=0")

    def started(env: dict, told: str | None, name: str) -> dict:
        child_env = {**os.environ, **({ENV: told} if told else {})}
        done = subprocess.run([sys.executable, "-c", STARTS_A_COORDINATOR, str(tmp_path / f"{name}.log"),
                               json.dumps(env)], env=child_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    import torch._inductor.config  # noqa: F401 - as `from_pretrained` does: the environment gains its cache folder

    assert preloaded_for("coordinator", [], dict(os.environ), None, 0) is preloaded, "what the image's imports set"
    told = exported("base")
    assert json.loads(told) == {"base": [preloaded.address, preloaded.env_digest]}
    assert started({}, told, "told") == {"forked": True, "parent": preloaded.proc.pid, "exit": 0}
    # the environment the image imported in, or nothing: a process of its own, as for the tests' own services
    assert started({"RLSYNC_LOG_LEVEL": "DEBUG"}, told, "other-env")["forked"] is False
    assert started({}, json.dumps({"base": ["@rlsync-preload-gone", preloaded.env_digest]}), "gone")["forked"] is False
    assert started({}, "{not what exported writes", "malformed")["forked"] is False


@NEEDS_SGLANG
@pytest.mark.sglang
def test_an_sglang_replica_is_forked_from_an_image_in_sglangs_environment(services, preloaded):
    if preloaded is None:
        pytest.skip("RLSYNC_TEST_PRELOAD=0")
    replica = services.start("rollout", rollout_args("sglang"), name="forked-sglang")
    image = preloaded_for("rollout", ["--engine", "sglang"], dict(os.environ), None, 0)
    assert image is not None and image.image == "sglang" and image is not preloaded
    assert psutil.Process(image.proc.pid).cmdline()[0] == sglang_python()
    assert isinstance(replica.proc, Forked) and psutil.Process(replica.proc.pid).ppid() == image.proc.pid
    (done,) = RolloutClient(replica.address).complete("3+4=", max_tokens=4, ignore_eos=True)
    assert len(done.token_ids) == 4
    assert replica.stop() == 0, replica.log_tail()  # SIGTERM: SGLang's processes end with it
