"""Shared fixtures: the tiny model, and real services started as separate processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from rlsync.launch import ServiceProcess  # noqa: E402
from rlsync.models import ensure_tiny_model  # noqa: E402

# Small, fast vLLM settings for the CPU build: eager mode, a 64 MiB KV cache.
VLLM_TEST_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 32}
HF_TEST_ARGS: dict = {}


def engine_args(engine: str, **extra) -> str:
    return json.dumps({**(VLLM_TEST_ARGS if engine == "vllm" else HF_TEST_ARGS), **extra})


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("service-logs")


class Services:
    """Starts services on free ports, logs each to its own file, stops them all at the end."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.started: list[ServiceProcess] = []

    def start(self, service: str, args: list[str], env: dict | None = None, wait: bool = True,
              name: str | None = None) -> ServiceProcess:
        name = name or service
        log = self.logs / f"{name}-{len(list(self.logs.iterdir()))}.log"
        proc = ServiceProcess(service, ["--port", "0", *args], env=env, log_path=log, name=name)
        self.started.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    def stop_all(self) -> None:
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
    """Module-scoped Services, for servers that several tests share."""
    s = Services(logs_dir)
    yield s
    s.stop_all()


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


def rollout_args(engine: str, *extra: str, **engine_extra) -> list[str]:
    return ["--engine", engine, "--engine-args", engine_args(engine, **engine_extra), *extra]
