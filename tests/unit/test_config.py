"""Typed config: flags beat environment, environment beats defaults; nested defaults survive."""

import argparse

import pytest

from rlsync.config import add_arguments, build, describe
from rlsync.rollout.config import DEFAULT_PORT, RolloutConfig


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, RolloutConfig)
    return parser.parse_args(argv)


def test_precedence_flag_over_env_over_default():
    env = {"RLSYNC_ENGINE": "hf", "RLSYNC_PORT": "6000", "RLSYNC_ENGINE_ARGS": '{"dtype": "bfloat16"}'}
    cfg = build(RolloutConfig, _parse(["--port", "7000"]), env=env)
    assert cfg.server.port == 7000 and cfg.engine == "hf" and cfg.engine_args == {"dtype": "bfloat16"}
    assert build(RolloutConfig, _parse([]), env={}).server.port == DEFAULT_PORT
    assert build(RolloutConfig, _parse([]), env={}).server.host == "127.0.0.1", "loopback by default"


def test_bad_values_exit_with_the_field_name():
    with pytest.raises(SystemExit, match="port"):
        build(RolloutConfig, _parse([]), env={"RLSYNC_PORT": "many"})
    with pytest.raises(SystemExit, match="engine"):
        build(RolloutConfig, _parse([]), env={"RLSYNC_ENGINE": "tgi"})
    with pytest.raises(SystemExit, match="engine_args"):
        build(RolloutConfig, _parse([]), env={"RLSYNC_ENGINE_ARGS": "[1, 2]"})


def test_secrets_are_masked_in_descriptions():
    cfg = build(RolloutConfig, _parse(["--token", "hunter2"]), env={})
    assert cfg.server.token == "hunter2" and describe(cfg)["token"] == "***"
