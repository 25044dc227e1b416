"""The coordinator with real trainer and replica processes: registry, late joiners, the gateway's
transparent resume through updates and dead replicas, aborts, bad input, staleness."""

from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, RpcError, TrainerClient, trajectory
from rlsync.common.audit import differences
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from streams import Stream


def start_fleet(services, mode="async", replicas=2, extra=()):
    co = services.start("coordinator", ["--sync-mode", mode, "--lease", "1.5", "--heartbeat-interval", "0.3", *extra],
                        name="coordinator")
    tr = services.start("trainer", ["--coordinator", co.address, "--checksums"], name="trainer")
    ros = [services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--replica-id", f"r{i}"],
                          name=f"r{i}") for i in range(replicas)]
    client = CoordinatorClient(co.address)
    client.wait_ready(replicas + 1)
    return client, tr, ros


def test_registry_late_joiner_caught_up_and_dead_replica_leaves(services):
    client, tr, ros = start_fleet(services, replicas=1)
    sync = rl_step(client)
    assert sync.version == 1 and sync.verified and sync.replicas == 1
    assert {"rpc", "connect", "data", "receiver_copy"} <= set(sync.transfer_profile)  # where the transfer's time went
    assert "prepare_ring" in sync.transfer_profile, "the trainer rang the replica on its host"
    late = services.start("rollout", [*rollout_args("hf"), "--coordinator", client.address, "--replica-id", "late"],
                          name="late")
    client.wait_ready(3)
    info = RolloutClient(late.address).info()
    assert info.weight_version == 1, "a late joiner gets the current weights before it takes traffic"
    assert differences(TrainerClient(tr.address).checksums(), RolloutClient(late.address).checksums()) == []
    ros[0].kill()
    start = time.monotonic()
    client.wait_ready(2, timeout=10)
    assert time.monotonic() - start < 5, "a replica that stops heartbeating leaves within the lease"
    assert client.complete("still", max_tokens=4, ignore_eos=True)[0].finish_reason == "length"


def test_a_replica_whose_process_group_gets_sigterm_deregisters_first_and_leaves_no_process(services):
    """Ctrl-C in a terminal, systemd's stop, `docker stop` of a shell: the whole group gets the signal. The
    replica's beacon waits for the replica to say it leaves, so it leaves in order, not at the lease."""
    from hangs import FAST
    from test_busy_members import drops, liveness, rollouts

    co = services.start("coordinator", ["--sync-mode", "async", *FAST, "--metrics-port", "0"], name="coordinator")
    ro = services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--replica-id", "r0"],
                        name="r0")
    client = CoordinatorClient(co.address)
    deadline = time.monotonic() + 60
    while rollouts(client) != ["r0"]:
        assert time.monotonic() < deadline, "the replica never joined"
        time.sleep(0.05)
    family = psutil.Process(ro.proc.pid).children(recursive=True)
    assert any("rlsync.rpc.beacon" in p.cmdline() for p in family)
    os.killpg(ro.proc.pid, signal.SIGTERM)
    ro.proc.wait(60)
    assert rollouts(client) == [] and drops(co) == "rollout deregistered: 1", liveness(co)
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], alive


def test_gateway_resumes_through_updates_and_a_dead_replica(services):
    client, _, ros = start_fleet(services, replicas=2)
    by_address = {p.address: p for p in ros}
    stream = Stream(client, "long", session_id="sticky", max_tokens=900, ignore_eos=True)
    assert stream.first.wait(30)
    rl_step(client, seed=1)  # an update mid-stream: paused, aborted, resubmitted on version 1
    serving = [m for m in client.status().members if m.role == pb.ROLE_ROLLOUT and m.in_flight > 0]
    assert len(serving) == 1
    by_address[serving[0].address].kill()  # ... and then its replica dies
    stream.thread.join(120)
    chunks = stream.chunks
    tokens = [tok for c in chunks for tok in c.token_ids]
    final = chunks[-1]
    assert final.finish_reason == 2 and len(tokens) == 900, "nothing lost, nothing duplicated"
    assert final.resubmissions >= 2
    assert [s.weight_version for s in final.version_spans][0] == 0 and final.max_weight_version == 1
    assert sum(s.length for s in final.version_spans) == 900
    assert chunks[0].prompt_token_ids and not any(c.prompt_token_ids for c in chunks[1:])


def test_gateway_relays_bad_input_and_aborts_on_request(services):
    client, _, _ = start_fleet(services, replicas=1)
    with pytest.raises(RpcError) as e:
        client.complete("hi", max_tokens=0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.message
    with pytest.raises(RpcError) as e:
        client.abort("nope")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    stream = Stream(client, "x", request_id="mine", max_tokens=900, ignore_eos=True)
    assert stream.first.wait(30)
    client.abort("mine")
    stream.thread.join(30)
    assert stream.chunks[-1].finish_reason == 3 and stream.chunks[-1].resubmissions == 0
    assert 0 < stream.tokens < 900


def test_staleness_is_flagged_and_passed_to_training(services):
    client, _, _ = start_fleet(services, replicas=1, extra=("--max-staleness", "0"))
    old = client.complete("3+4=", n=4, max_tokens=6, temperature=1.0, logprobs=True, seed=3)
    assert not any(c.stale for c in old)
    client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(old)])  # step 1, no sync
    again = client.complete("3+4=", max_tokens=4, ignore_eos=True)[0]
    assert again.stale and again.max_weight_version == 0
    r = client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(old)])
    assert r.stale == 4 and r.dropped == 4, "older than max_staleness: dropped by the configured policy"
