"""A fleet on a real multi-node Ray cluster, made on this machine with Ray's own test utilities.

Three Ray nodes to start with: the head runs the control unit (coordinator + trainer) and the
`near` replica; two `far` nodes run a replica each. Two Ray nodes are two hosts to rlsync: the
handshake picks shm on the trainer's node and gloo across nodes. The tests run in order on one
fleet: RL steps, scaling up (a node joins) and down (a replica drains), and losing a node while
requests stream (its replica leaves, the requests finish elsewhere, a new node gets it back).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from rlsync.client import RolloutClient  # noqa: E402
from rlsync.demo.loop import LoopConfig, run_loop  # noqa: E402
from rlsync.demo.task import DigitsTask  # noqa: E402
from rlsync.fleet import load, parse  # noqa: E402
from rlsync.fleet.launcher import Fleet  # noqa: E402

pytestmark = pytest.mark.slow

FLEET = """
name: test
coordinator: {port: 0, args: ["--lease", "2"]}
trainer: {resources: {head: 1}}
rollout:
  - {name: near, engine: hf, replicas: 1, resources: {head: 1}}
  - {name: far, engine: hf, replicas: 2, resources: {far: 1}}
"""


@pytest.fixture(scope="module")
def cluster(tiny_model):
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"head": 2}})
    c.far = [c.add_node(num_cpus=1, resources={"far": 1}) for _ in range(2)]
    ray.init(address=c.address, namespace="rlsync", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster):
    f = Fleet.up(parse(FLEET), timeout=240)  # within pytest's 300 s: a fleet that does not come up says why
    f.wait_ready(120)
    yield f
    f.down()


def members(fleet: Fleet) -> dict[str, dict]:
    return {m["name"]: m for m in fleet.status()["members"]}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_placement_follows_the_fleet_file_and_the_handshake_follows_the_nodes(fleet, cluster):
    m = members(fleet)
    head = cluster.head_node.node_id
    assert m["coordinator"]["node_id"] == m["trainer"]["node_id"] == m["near-0"]["node_id"] == head
    far_nodes = {m["far-0"]["node_id"], m["far-1"]["node_id"]}
    assert far_nodes == {n.node_id for n in cluster.far}
    for member in m.values():  # every advertised address is the node's, dialable from other nodes
        assert member["address"].rpartition(":")[0] == member["ip"] and not member["ip"].startswith("127.")
        if os.geteuid() == 0:  # the host may lower it: not the 15 of the Ray worker that started the member
            assert os.getpriority(os.PRIO_PROCESS, member["pid"]) == 0
    with fleet.client() as c:
        result = c.sync_weights(verify=True)
    assert result.verified and result.replicas == 3
    assert dict(result.backends) == {"shm": 1, "gloo": 2}


def test_rl_steps_sync_and_verify_across_nodes(fleet, tiny_model):
    from transformers import AutoTokenizer

    task = DigitsTask(AutoTokenizer.from_pretrained(tiny_model), 8)
    cfg = LoopConfig(steps=2, prompts_per_step=3, group_size=4, max_tokens=8)
    records = asyncio.run(run_loop(fleet.coordinator, task, cfg))
    assert [r.weights_verified for r in records] == [True, True]
    assert records[1].version > records[0].version >= 1
    assert {v["weight_version"] for v in members(fleet).values() if v["role"] == "rollout"} == {records[1].version}


def test_scale_up_waits_for_a_node_catches_up_then_takes_traffic_and_scale_down_drains(fleet, cluster):
    with fleet.client() as c:
        version = c.sync_weights().version
    scaled: dict = {}
    scaling = threading.Thread(target=lambda: scaled.update(fleet.scale("far", 3)))
    scaling.start()
    wait_for(lambda: members(fleet).get("far-2", {}).get("state") == "pending", 30, "far-2 to wait for a node")
    cluster.far.append(cluster.add_node(num_cpus=1, resources={"far": 1}))
    scaling.join(120)
    assert scaled["added"] == ["far-2"]
    new = wait_for(lambda: (m := members(fleet)["far-2"])["registered"] == "ready" and m, 60, "far-2 in rotation")
    assert new["weight_version"] == version and new["node_id"] == cluster.far[-1].node_id
    with RolloutClient(new["address"]) as replica, fleet.client() as c:
        assert replica.info().weight_version == version  # caught up before it took traffic
        before = replica.info().requests_admitted
        threads = [threading.Thread(target=c.complete, args=("numbers:",), kwargs={"max_tokens": 8})
                   for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert replica.info().requests_admitted > before

        # Scale down while streams keep every replica busy (the gateway spreads them by load): the
        # one that goes drains (its streams finish, there or resumed elsewhere), then stops.
        done, errors, stop = [], [], threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    done.append(c.complete("numbers:", max_tokens=64, ignore_eos=True)[0])
                except Exception as e:  # noqa: BLE001 - counted: none may fail
                    errors.append(e)

        streams = [threading.Thread(target=load) for _ in range(4)]
        [t.start() for t in streams]
        try:
            wait_for(lambda: replica.info().in_flight > 0, 30, "a stream on far-2")  # what it must drain
            assert fleet.scale("far", 2)["removed"] == ["far-2"]
        finally:
            stop.set()
            [t.join(60) for t in streams]
    assert not errors and done and all(len(d.token_ids) == 64 for d in done)
    assert "far-2" not in members(fleet)
    assert any(e["member"] == "far-2" and e["kind"] == "stopped" and "exited with status 0" in e["detail"]
               for e in fleet.events())
    cluster.remove_node(cluster.far.pop())  # its node goes back, as an autoscaler would do


def test_a_lost_node_leaves_rotation_its_requests_finish_elsewhere_and_it_comes_back(fleet, cluster):
    victim = members(fleet)["far-1"]
    node = next(n for n in cluster.far if n.node_id == victim["node_id"])
    results, errors, stop = [], [], threading.Event()

    def generate() -> None:
        with fleet.client() as c:
            while not stop.is_set():
                try:
                    results.append(c.complete("numbers:", max_tokens=48, ignore_eos=True)[0])
                except Exception as e:  # noqa: BLE001 - counted: none may fail
                    errors.append(e)

    with fleet.client() as c:
        resubmitted = c.status().resubmissions
    streams = [threading.Thread(target=generate) for _ in range(4)]
    [t.start() for t in streams]
    try:
        with RolloutClient(victim["address"]) as replica:
            wait_for(lambda: replica.info().in_flight > 0, 30, "a request on far-1")
        # The machine vanishes: Ray loses the node, and its processes die at once (no drain).
        cluster.remove_node(node, allow_graceful=False)
        os.killpg(victim["pid"], signal.SIGKILL)
        cluster.far.remove(node)
        wait_for(lambda: members(fleet)["far-1"]["state"] == "pending", 30, "far-1 to wait for a node")
        wait_for(lambda: [e for e in fleet.events() if e["kind"] == "node-lost" and "it ran far-1" in e["detail"]],
                 60, "the launcher to report the lost node")
    finally:  # the streams end with the test, passed or not (they would load every test after it)
        stop.set()
        [t.join(120) for t in streams]
    assert not errors and results and all(len(r.token_ids) == 48 for r in results)
    with fleet.client() as c:
        assert c.status().resubmissions > resubmitted  # what was cut short resumed on the others

    with fleet.client() as c:  # the fleet syncs without it meanwhile
        version = c.sync_weights(verify=True).version
    cluster.far.append(cluster.add_node(num_cpus=1, resources={"far": 1}))
    back = wait_for(lambda: (m := members(fleet)["far-1"])["registered"] == "ready" and m, 90, "far-1 back")
    assert back["restarts"] == 1 and back["node_id"] == cluster.far[-1].node_id
    assert back["weight_version"] == version
    with fleet.client() as c:
        result = c.sync_weights(verify=True)
    assert result.verified and dict(result.backends) == {"shm": 1, "gloo": 2}


COLOCATED = """
name: colo
sync: colocated
coordinator: {port: 0}
trainer: {gpus_per_rank: 1, resources: {colo: 1}}
rollout: [{engine: hf, replicas: 1, gpus: 1}]
"""


def environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_colocated_puts_the_trainer_and_its_replica_in_one_gpu_bundle(cluster, tiny_model):
    """Ray's GPUs here are logical (this machine has none): the placement is what is checked; the
    services then run on the CPU, and the colocated sequence syncs through shared memory."""
    node = cluster.add_node(num_cpus=3, num_gpus=1, resources={"colo": 1})
    fleet = Fleet.up(parse(COLOCATED))
    try:
        fleet.wait_ready(120)
        m = members(fleet)
        assert m["trainer"]["node_id"] == m["rollout-0"]["node_id"] == m["coordinator"]["node_id"] == node.node_id
        gpus = [environ(m[name]["pid"]).get("CUDA_VISIBLE_DEVICES") for name in ("trainer", "rollout-0")]
        assert gpus[0] == gpus[1] and gpus[0] not in (None, "")  # one GPU, shared
        with pytest.raises(Exception, match="colocated replicas share the trainer's GPU"):
            fleet.scale("rollout", 2)
        with fleet.client() as c:
            result = c.sync_weights(verify=True)
        assert result.verified and dict(result.backends) == {"shm": 1}
        assert set(result.phases) >= {"wake_weights", "offload", "wake_kv_cache"}  # the colocated sequence
    finally:
        fleet.down()
        cluster.remove_node(node)


def test_a_training_script_of_ones_own_is_the_fleets_trainer(cluster, tiny_model, tmp_path):
    """trainer.script: the user's loop (examples/plain_publish.py, which embeds WeightPublisher) runs
    under the fleet: it finds the coordinator through the environment the launcher sets, publishes
    every step, and its exit is reported with its status."""
    script = Path(__file__).parents[2] / "examples" / "plain_publish.py"
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(f"""
name: own
coordinator: {{port: 0}}
trainer: {{script: {script}, args: ["--steps", "2"], resources: {{own: 1}}}}
rollout: [{{engine: hf, replicas: 1, resources: {{own: 1}}}}]
""")
    node = cluster.add_node(num_cpus=2, resources={"own": 2})
    fleet = Fleet.up(load(fleet_file))
    try:
        ended = wait_for(lambda: [e for e in fleet.events() if e["member"] == "trainer" and e["kind"] == "exited"],
                         180, "the training script to finish")
        assert ended[0]["detail"].startswith("exited with status 0"), ended[0]["detail"]
        assert '"step": 2' in ended[0]["detail"] and '"verified": true' in ended[0]["detail"]
        replica = members(fleet)["rollout-0"]
        with RolloutClient(replica["address"]) as r:
            assert r.info().weight_version == 2  # what the script published last
        assert replica["node_id"] == node.node_id
    finally:
        fleet.down()
        cluster.remove_node(node)


def test_a_replica_that_cannot_start_is_retried_after_a_pause_and_up_fails_with_its_reason(cluster, tiny_model):
    node = cluster.add_node(num_cpus=2, resources={"bad": 2})
    spec = parse("""
name: bad
coordinator: {port: 0}
trainer: {resources: {bad: 1}}
rollout: [{engine: hf, replicas: 1, resources: {bad: 1}, args: ["--engine-args", "[1, 2]"]}]
""")
    seen: list[dict] = []
    try:
        with pytest.raises(Exception, match="did not come up") as refused:  # after 2 tries, not the timeout
            Fleet.up(spec, timeout=240, on_event=seen.append)
        assert "rollout-0 (pending; ended 2 times" in str(refused.value) and "engine_args" in str(refused.value)
        exits = [e for e in seen if e["member"] == "rollout-0" and e["kind"] == "exited"]
        assert exits and "exited with status" in exits[0]["detail"] and "engine_args" in exits[0]["detail"]
        assert any(e["kind"] == "restarting" and " in 2s " in e["detail"] for e in seen)  # a pause, not a spin
        with pytest.raises(ValueError):
            ray.get_actor("bad", namespace="rlsync")  # nothing left behind
    finally:
        cluster.remove_node(node)
