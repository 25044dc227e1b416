"""The fleet file: what it accepts, and what it refuses with the path to the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsync.errors import InvalidArgument
from rlsync.fleet.spec import decode, encode, load, parse
from rlsync.address import advertise_host, advertised

EXAMPLES = Path(__file__).parents[2] / "examples" / "fleets"


@pytest.mark.parametrize("name", ["local.yaml", "cluster.yaml", "own-trainer.yaml"])
def test_the_example_fleet_files_are_valid_and_survive_the_trip_to_the_fleet_actor(name):
    spec = load(EXAMPLES / name)
    assert decode(encode(spec)) == spec
    if spec.trainer.script:  # relative to the fleet file, made absolute for the nodes
        assert Path(spec.trainer.script).is_absolute() and Path(spec.trainer.script).exists()


def test_defaults_make_a_whole_fleet():
    spec = parse("{}")
    assert (spec.name, spec.sync, spec.model, spec.coordinator.port) == ("rlsync", "async", "tiny", 50050)
    assert [(g.name, g.engine, g.replicas) for g in spec.rollout] == [("rollout", "vllm", 1)]


@pytest.mark.parametrize("text, where", [
    ("rollout: [{engine: tgi}]", "$.rollout[0].engine"),
    ("rollout: [{replicas: two}]", "$.rollout[0].replicas"),
    ("trainer: {nproc: 1.5}", "$.trainer.nproc"),
    ("coordinator: {prot: 1}", "unknown field `prot`"),
    ("sync: sometimes", "$.sync"),
    ("rollout: [{}, {}]", "rollout[1] (rollout).name: 'rollout' is used twice"),
    ("rollout: [{replicas: -1}]", "rollout[0] (rollout).replicas"),
    ("rollout: [{gpus: 1.5}]", "must be a whole number"),
    ("name: My_Fleet", "name: 'My_Fleet'"),
    ("rollout: []", "at least one group"),
    ("coordinator: {port: 70000}", "coordinator.port"),
    ("sync: colocated\ntrainer: {nproc: 2}", "sync: colocated"),
    ("sync: colocated\nrollout: [{name: a}, {name: b}]", "sync: colocated"),
    ("rollout: [", "not valid YAML"),
])
def test_a_bad_fleet_file_is_refused_with_the_field_named(text, where):
    with pytest.raises(InvalidArgument) as e:
        parse(text)
    assert where in str(e.value)


def test_a_missing_fleet_file_says_so(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read the fleet file"):
        load(tmp_path / "nope.yaml")


@pytest.mark.parametrize("bind, advertise, expected, host", [
    ("127.0.0.1", "", "127.0.0.1:7", None),
    ("0.0.0.0", "10.1.2.3", "10.1.2.3:7", "10.1.2.3"),  # what `rlsync up` sets: the node's address
    ("0.0.0.0", "gateway.example:443", "gateway.example:443", "gateway.example"),  # behind a port mapping
    ("0.0.0.0", "[fd00::1]:9", "[fd00::1]:9", "fd00::1"),
    ("0.0.0.0", "fd00::1", "[fd00::1]:7", "fd00::1"),
])
def test_the_advertised_address_is_the_one_others_dial(bind, advertise, expected, host):
    assert advertised(bind, 7, advertise) == expected
    assert advertise_host(advertise) == host


def test_the_node_a_launcher_names_is_the_handshakes_host(monkeypatch):
    from rlsync.transfer import handshake

    handshake.host_id.cache_clear()
    monkeypatch.setenv("RLSYNC_NODE_ID", "ray-node-a")
    try:
        assert handshake.local_facts().host_id == "ray-node-a"
    finally:
        handshake.host_id.cache_clear()
