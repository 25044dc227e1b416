"""Members that hang (SIGSTOP: alive, silent, answering nothing) instead of dying, real processes
throughout. The registry's lease is the one source of liveness: once it drops a hung replica, a
sync in any phase and mode goes on with the survivors in the same SyncWeights call and the gateway
resumes its streams elsewhere; a hung coordinator's replicas take themselves back after their own
lease and it re-adopts them when it wakes; a hung trainer fails the sync within the lease while
every replica serves on. Each test prints how long the fleet took to move on."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, RpcError, TrainerClient, trajectory
from rlsync.common.audit import differences
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from hangs import FAST, SLOW, in_background, report, train, wait_prepared
from streams import Stream

SERVING = 1  # rollout_pb2.SERVING_STATE_SERVING


@pytest.fixture
def freeze(services):
    """freeze(proc) -> the moment it stopped its process group (SIGSTOP); thawed at teardown."""
    frozen = []

    def stop(proc) -> float:
        os.killpg(proc.proc.pid, signal.SIGSTOP)
        frozen.append(proc)
        return time.monotonic()

    yield stop
    for proc in frozen:
        thaw(proc)


def thaw(proc) -> None:
    try:
        os.killpg(proc.proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def fleet(services, mode="async", replicas=2, model=None, co_extra=(), trainer_extra=(), replica_extra=()):
    co = services.start("coordinator", ["--sync-mode", mode, *FAST, *co_extra], name="coordinator")
    models = ["--model", str(model)] if model else []
    tr = services.start("trainer", ["--coordinator", co.address, "--checksums", *models, *trainer_extra],
                        name="trainer")
    ros = [services.start("rollout", [*rollout_args("hf"), *models, "--coordinator", co.address, "--replica-id",
                                      f"r{i}", *replica_extra], name=f"r{i}") for i in range(replicas)]
    client = CoordinatorClient(co.address)
    client.wait_ready(replicas + 1)
    return co, client, tr, ros


def test_a_replica_hung_mid_transfer_is_dropped_and_the_survivor_gets_the_update(services, small_model, freeze):
    co, client, tr, ros = fleet(services, model=small_model, **SLOW)
    first = rl_step(client, 0)
    assert first.version == 1 and first.replicas == 2 and first.verified
    print(f"\n[hung] a sync of the small model: {first.seconds:.1f}s {dict(first.phases)}")
    train(client, 1)
    r0, r1 = (RolloutClient(p.address) for p in ros)
    sync = in_background(client.sync_weights, None, "", True)
    wait_prepared([r0, r1])
    time.sleep(0.2)  # the publish is under way
    stopped = freeze(ros[1])
    second = sync.result(120)
    report("sync, r1 hung mid-transfer", time.monotonic() - stopped, second)
    assert second.version == 2 and second.replicas == 1 and second.verified, second
    assert r0.info().weight_version == 2
    assert [m.name for m in client.status().members if m.role == pb.ROLE_ROLLOUT] == ["r0"]
    assert client.complete("on", max_tokens=4, ignore_eos=True)[0].max_weight_version == 2
    thaw(ros[1])  # it registers again and is caught up before it takes traffic
    client.wait_ready(3, timeout=60)
    assert r1.info().weight_version == 2 and r1.info().pending_version == -1
    assert differences(TrainerClient(tr.address).checksums(), r1.checksums()) == []


@pytest.mark.parametrize("mode, at", [("async", "sync"), ("inflight", "sync"), ("colocated", "sync"),
                                      ("colocated", "train")])
def test_a_replica_hung_before_a_step_is_left_out_in_every_mode(services, freeze, mode, at):
    """Hung before the sync: async and inflight, the trainer rings its doorbell with the offer (its
    prepare) and never hears back; colocated, its weights are woken first (WakeUp). Hung before the
    training step (colocated): the engines are put to sleep first (Sleep)."""
    co, client, tr, ros = fleet(services, mode)
    assert rl_step(client, 0).version == 1
    done = client.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=1)
    stopped = freeze(ros[1]) if at == "train" else None
    client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    stopped = stopped or freeze(ros[1])
    sync = client.sync_weights(verify=True)
    report(f"{mode}, r1 hung before the {'training step' if at == 'train' else 'sync'}", time.monotonic() - stopped)
    assert sync.version == 2 and sync.replicas == 1 and sync.verified, sync
    assert RolloutClient(ros[0].address).info().weight_version == 2
    assert client.complete("on", max_tokens=4, ignore_eos=True)[0].max_weight_version == 2


def test_a_hung_replicas_stream_resumes_on_another_replica(services, freeze):
    co, client, tr, ros = fleet(services)
    by_address = {p.address: p for p in ros}
    stream = Stream(client, "long", session_id="sticky", max_tokens=900, ignore_eos=True)
    assert stream.first.wait(30)

    def serving():
        return [m for m in client.status().members if m.role == pb.ROLE_ROLLOUT and m.in_flight > 0]

    first = serving()
    assert len(first) == 1
    stopped = freeze(by_address[first[0].address])
    deadline = time.monotonic() + 60
    while not (now := serving()) or now[0].address == first[0].address:
        assert time.monotonic() < deadline and stream.thread.is_alive(), "the stream was never resumed"
        time.sleep(0.05)
    report("a stream on a hung replica", time.monotonic() - stopped)
    stream.thread.join(120)
    assert stream.error is None, stream.error
    tokens = [t for c in stream.chunks for t in c.token_ids]
    final = stream.chunks[-1]
    assert final.finish_reason == 2 and len(tokens) == 900, "nothing lost, nothing duplicated"
    assert final.resubmissions >= 1 and sum(s.length for s in final.version_spans) == 900


def test_replicas_left_paused_by_a_hung_coordinator_take_themselves_back_and_it_readopts_them(services, freeze):
    co, client, tr, ros = fleet(services, replicas=1, replica_extra=("--coordinator-lease", "2"))
    trainer, replica = TrainerClient(tr.address), RolloutClient(ros[0].address)
    assert rl_step(client, 0).version == 1
    # What a coordinator leaves mid-sync (see test_coordinator_restart.py): paused, N+1 prepared.
    replica.pause("abort")
    replica.prepare_update(trainer.offer_weights(2).offer)
    assert replica.info().state != SERVING and replica.info().pending_version == 2
    stopped = freeze(co)
    deadline = time.monotonic() + 60
    while (info := replica.info()).state != SERVING:
        assert time.monotonic() < deadline, f"still {info.state} 60 s after its coordinator hung"
        time.sleep(0.1)
    report("a replica left paused by a hung coordinator", time.monotonic() - stopped)
    assert info.pending_version == -1 and info.weight_version == 1 and info.memory.staging_bytes == 0
    assert replica.complete("on my own", max_tokens=4, ignore_eos=True)[0].max_weight_version == 1
    thaw(co)
    woke = time.monotonic()
    client.wait_ready(2, timeout=60)
    print(f"\n[hung] the coordinator re-adopted its fleet {time.monotonic() - woke:.1f}s after SIGCONT")
    sync = rl_step(client, 1)
    assert sync.version == 2 and sync.verified and sync.replicas == 1
    assert replica.info().weight_version == 2


def test_a_trainer_hung_mid_publish_fails_the_sync_within_the_lease_and_replicas_serve_on(services, small_model,
                                                                                          freeze):
    co, client, tr, ros = fleet(services, model=small_model, **SLOW)
    assert rl_step(client, 0).version == 1
    train(client, 1)
    replicas = [RolloutClient(p.address) for p in ros]
    sync = in_background(client.sync_weights, None, "", True)
    wait_prepared(replicas)
    time.sleep(0.2)  # the publish is under way
    stopped = freeze(tr)
    with pytest.raises(RpcError) as e:
        sync.result(120)
    report("sync, trainer hung mid-publish", time.monotonic() - stopped)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
    assert "trainer left the fleet: no heartbeat" in e.value.message and "abandoned" in e.value.message, e.value
    for r in replicas:
        info = r.info()
        assert info.state == SERVING and info.weight_version == 1 and info.pending_version == -1, info
    out = client.complete("on", max_tokens=4, ignore_eos=True)[0]
    assert out.finish_reason == "length" and out.max_weight_version == 1
    thaw(tr)
    client.wait_ready(3, timeout=60)
    again = rl_step(client, 2)
    assert again.version == 3 and again.replicas == 2 and again.verified, again
