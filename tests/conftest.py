"""Shared fixtures: the tiny model, and real services started as separate processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# A one-worker vLLM replica runs its model in the engine-core process (vLLM's "uni" executor, as on
# one GPU) rather than in a third process: vLLM's CPU platform spawns one per worker unless this is 0
# (for OpenMP thread binding, which tests do not need). It saves ~7 s and a process per replica
# start; tensor-parallel replicas still get one process per worker.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# An FP8 vLLM replica on a GPU compiles DeepGEMM's kernels for every batch size it may meet before it serves
# (55 s of the tiny FP8 model's start on an H200); a test's replica compiles those it runs, when it runs them.
os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
# OpenMP threads that wait by sleeping, not spinning: every service the tests start (vLLM's workers, the
# hf engine's and the trainer's torch) shares the CI machine's two cores with two other suites, and a
# spinning wait takes a core from whichever process holds the work (a two-worker vLLM replica's first
# eight tokens took 23 s spinning, 4 s sleeping).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# No torch.compile in the engines the tests start on a machine without a GPU (vLLM's logprob ranks, SGLang's
# seeded sampling): each engine process traced them and had Inductor compile C++ (a CI run from a cold cache
# spent 40-70 CPU-s in the C++ compiler alone; test_rollout_api's vLLM tests 66 -> 54 CPU-s without). They run
# the same code eagerly. On a GPU machine they compile, as deployments do.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

pytest_plugins = ["cpu_time"]  # RLSYNC_TEST_CPU=FILE: each test's CPU time (tests/cpu_time.py)

from rlsync import preload  # noqa: E402
from rlsync.client import trajectory  # noqa: E402
from rlsync.launch import ServiceProcess, python_for, sglang_python  # noqa: E402
from rlsync.models import ensure_tiny_model  # noqa: E402

# Small, fast vLLM settings for the CPU build: eager mode, a 64 MiB KV cache.
VLLM_TEST_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 32}
HF_TEST_ARGS: dict = {}


# SGLang runs in its own environment (`make venv-sglang`; rlsync.launch starts its replicas with that
# Python): the tests parametrized with it skip, saying so, where it is not built.
NEEDS_SGLANG = pytest.mark.skipif(sglang_python() is None, reason="no SGLang environment: run make venv-sglang")


def engines(*names: str) -> list:
    """Engine parameters for a test or fixture: sglang only where its environment is built."""
    return [pytest.param(n, marks=[NEEDS_SGLANG, pytest.mark.sglang]) if n == "sglang" else n for n in names]


def engine_args(engine: str, **extra) -> str:
    return json.dumps({**(VLLM_TEST_ARGS if engine == "vllm" else HF_TEST_ARGS), **extra})


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


@pytest.fixture(scope="session", autouse=True)
def preload_images(tmp_path_factory):
    """Coordinators, trainers and hf replicas started by the tests are forked from one process that
    imported torch and transformers once (rlsync.preload): ~5 s of CPU less each, a few hundred
    times; one-worker vLLM replicas from a second that imported vLLM too (~10 s less each), SGLang
    replicas from a third in SGLang's environment (the SGLang tests' CPU time halved). Each is made when
    the first service that needs it starts, with the environment the session had here (a session that
    starts none, as the Ray fleet's and the compose test's, pays for none: ~5 CPU-s each). A process a
    test starts that starts services itself (the demo) is told of them (preload.exported, RLSYNC_PRELOADED).
    RLSYNC_TEST_PRELOAD=0: each starts in a process of its own, as outside the tests."""
    if os.environ.get("RLSYNC_TEST_PRELOAD", "1") == "0":
        yield
        return
    ensure_tiny_model()  # (built before the fork: nothing in the preloaded image builds it)
    logs = tmp_path_factory.mktemp("preloaded")
    env = dict(os.environ)  # (what the images start with, and their children must be given)
    made = []

    def maker(image: str, python: str = sys.executable):  # the first service of the image pays its import, once
        def make() -> preload.Preloaded:
            made.append(preload.Preloaded(logs / f"preloaded-{image}.log", image=image, env=env, python=python))
            return made[-1]
        return make

    images = {"vllm": maker("vllm")}
    if (python := sglang_python()) is not None:
        images["sglang"] = maker("sglang", python)
    preload.use(maker("base"), images)
    yield
    preload.use(None)
    for image in made:
        image.close()


@pytest.fixture
def preloaded(preload_images) -> preload.Preloaded | None:
    """The session's base image, made now if not yet (None with RLSYNC_TEST_PRELOAD=0)."""
    return preload.made("base")


@pytest.fixture(scope="session")
def vllm_sockets():
    """A folder for the interprocess sockets of the vLLM engines the tests run in this process, removed at
    the end (a vLLM replica service makes one of its own): vLLM's default is /tmp, where each engine left
    its sockets behind (11 a run of the suite)."""
    path = tempfile.mkdtemp(prefix="rlsync-vllm-rpc-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def keeps_environ(vllm_sockets):
    """For a module that runs vLLM in this process: vLLM sets environment variables as it imports and
    configures an engine (LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD, ...). They are put back after the
    module, so that services started later get the test session's environment: that of the preloaded
    image, which they are then forked from (with vLLM's, each started in a process of its own). Its
    sockets go to `vllm_sockets` (one folder for the session: vLLM may keep the value it read)."""
    saved = dict(os.environ)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", vllm_sockets)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Services:
    """Starts services on free ports, logs each to its own file, stops them all at the end."""

    live: list[Services] = []  # every Services whose processes are up, for the checks below

    def __init__(self, logs: Path, shared: bool = False):
        self.logs = logs
        self.shared = shared  # several tests use these: each checks first that they are up
        self.started: list[ServiceProcess] = []
        Services.live.append(self)

    def start(self, service: str, args: list[str], env: dict | None = None, wait: bool = True,
              name: str | None = None, script: Path | None = None, prefix: tuple[str, ...] = ()) -> ServiceProcess:
        """script: a Python file that runs the service itself (say, with a fault injected first; forked from the
        preloaded image as the service would be);
        prefix: a command the service runs under (`ip netns exec NS`: in a network namespace)."""
        name = name or service
        log = self.logs / f"{name}-{len(list(self.logs.iterdir()))}.log"
        args = ["--port", "0", *args]
        main = [str(script)] if script else ["-m", f"rlsync.{service}"]
        proc = ServiceProcess(service, args, env=env, log_path=log, name=name, script=script,
                              command=[*prefix, python_for(service, args), *main, *args] if prefix else None)
        self.started.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    def down(self) -> list[str]:
        """What is wrong with each started service (exited, killed by a signal, NOT_SERVING)."""
        return [why for proc in self.started if (why := proc.why_down())]

    def stop_all(self) -> None:
        Services.live.remove(self)
        for proc in reversed(self.started):
            proc.stop()


@pytest.fixture
def services(logs_dir, tiny_model):
    """Function-scoped: services(...).start("rollout", [...]) -> a ready ServiceProcess."""
    s = Services(logs_dir)
    yield s
    s.stop_all()


@pytest.fixture(scope="module")
def module_services(logs_dir, tiny_model):
    """Module-scoped Services, for servers that several tests share: each test first checks they
    are still up, so one dead replica fails with its cause instead of as a cascade of timeouts."""
    s = Services(logs_dir, shared=True)
    yield s
    s.stop_all()


@pytest.fixture(autouse=True)
def shared_services_up():
    for s in Services.live:
        problems = s.down() if s.shared else []
        if problems:
            pytest.fail("a service this test shares is down:\n" + "\n".join(problems), pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says which services were down and why (exit signal, log path), and what each said
    last at WARNING or above (a flake under CI's load leaves its cause there: a member dropped, and why)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and Services.live:
        problems = [why for s in Services.live for why in s.down()]
        if problems:
            report.sections.append(("rlsync services down", "\n".join(problems)))
        for proc in (p for s in Services.live for p in s.started):
            said = [line for line in proc.log_text().splitlines()
                    if any(f" {level} " in line for level in ("WARNING", "ERROR", "CRITICAL"))][-15:]
            if said:
                report.sections.append((f"{proc.name} warned ({proc.log_path})", "\n".join(said)))


@pytest.fixture(scope="session")
def zoo_file(tmp_path_factory) -> tuple[Path, dict]:
    """A safetensors file of every dtype and awkward shape, and its tensors."""
    from safetensors.torch import save_file

    from transfer_helpers import zoo

    tensors = zoo()
    path = tmp_path_factory.mktemp("zoo") / "zoo.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A bigger model (~90 MB float32): freeing it shows in resident memory, moving it takes time."""
    from rlsync.models import TinyRecipe, build_tiny_model

    recipe = TinyRecipe(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=64, intermediate_size=1536)
    return build_tiny_model(tmp_path_factory.mktemp("small") / "model", recipe)


def as_left(replica, version: int) -> None:
    """A shared replica is as the test before left it: on `version`, serving (not paused, not asleep, not
    dead), nothing prepared and no request in flight. Checked first by each test that shares one, so that
    an order change or a failing neighbour fails here, saying what it left, not later as a puzzle."""
    from rlsync.rollout.v1 import rollout_pb2

    info = replica.info()
    left = {"weight_version": info.weight_version, "pending_version": info.pending_version,
            "state": rollout_pb2.ServingState.Name(info.state), "asleep": len(info.asleep),
            "in_flight": info.in_flight, "dead_reason": info.dead_reason}
    assert left == {"weight_version": version, "pending_version": -1, "state": "SERVING_STATE_SERVING", "asleep": 0,
                    "in_flight": 0, "dead_reason": ""}, f"the shared replica was not left as expected: {left}"


def rollout_args(engine: str, *extra: str, **engine_extra) -> list[str]:
    return ["--engine", engine, "--engine-args", engine_args(engine, **engine_extra), *extra]


GREEDY_PROMPT = "the model reads"  # greedy_against_transformers' prompt (a test may serve it earlier, to cache it)


def greedy_against_transformers(rollout, checkpoint: str, count: int = 12) -> tuple[list[int], list[int]]:
    """(the replica's greedy tokens, transformers' on the checkpoint) for one prompt, `count` tokens each."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = rollout.complete(GREEDY_PROMPT, max_tokens=1)[0].prompt_token_ids
    want = model.generate(torch.tensor([prompt]), max_new_tokens=count, min_new_tokens=count, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    got = rollout.complete(prompt, max_tokens=count, temperature=0, ignore_eos=True)[0].token_ids
    return got, want


def two_gloo_ranks(script: Path, results: int) -> None:
    """Runs `script` as ranks 0 and 1 of a gloo group (separate processes); each prints one JSON line
    {"wrong": [...], "checked": [...]}: none wrong and `results` checked on each."""
    import socket
    import subprocess
    import sys

    for attempt in range(3):  # a free port can be taken by another process before rank 0 listens on it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "RANK": str(r), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}) for r in range(2)]
        outs = [procs[0].communicate(timeout=120)[0]]
        if procs[0].returncode != 0 and "EADDRINUSE" in outs[0] and attempt < 2:
            procs[1].kill()  # (it waits for rank 0's store)
            procs[1].wait()
            continue
        outs.append(procs[1].communicate(timeout=120)[0])
        break
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for out in outs:
        (result,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert result["wrong"] == [] and len(result["checked"]) == results


def rl_step(client, seed: int = 0):
    """One RL step through a coordinator: a group of 4 completions, a train step on them, a
    verified sync; returns the SyncWeightsResponse."""
    done = client.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=seed)
    client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    return client.sync_weights(verify=True)


def peft_policy(model_dir, checkpoint):
    """The peft model a LoRA trainer saved in `checkpoint` (its adapter/ folder), on its base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(Path(checkpoint) / "adapter"))


def interpreted(script: str, seed: int) -> dict:
    """The JSON line `script` prints, run with Triton's interpreter (a kernel on the CPU)."""
    done = subprocess.run([sys.executable, "-c", script, str(seed)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
