"""The coordinator dies (SIGKILL) in the middle of a sync, with real trainer and replica processes.
Restarted on the same address, it takes back what the old one left paused and mid-update, learns the
fleet's version and the trainer's step from the members, and carries on. Not restarted, the replicas
it left paused take themselves back once its lease runs out."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, RpcError, TrainerClient
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from streams import Stream
from transfer_helpers import free_port

FAST = ["--sync-mode", "async", "--lease", "1.5", "--heartbeat-interval", "0.3"]


def _fleet(services, replica_extra=()):
    co = services.start("coordinator", FAST, name="coordinator")
    tr = services.start("trainer", ["--coordinator", co.address, "--checksums"], name="trainer")
    ro = services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, *replica_extra], name="r0")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    return co, client, TrainerClient(tr.address), RolloutClient(ro.address)


def _left_mid_sync(trainer: TrainerClient, replica: RolloutClient) -> None:
    """What a coordinator leaves when it dies between steps of a sync: the replica paused, with the
    next version prepared (staging allocated) but never committed."""
    replica.pause("abort")
    replica.prepare_update(trainer.offer_weights(replica.info().weight_version + 1).offer)
    info = replica.info()
    assert info.state == 2 and info.pending_version >= 0  # PAUSED, holding a prepared update


def test_restarted_coordinator_takes_back_a_paused_replica_and_carries_on(services):
    co, client, trainer, replica = _fleet(services)
    assert rl_step(client, seed=0).version == 1
    _left_mid_sync(trainer, replica)
    co.kill()
    with pytest.raises(RpcError) as down:  # not idempotent: fails at once, saying it may be retried
        client.sync_weights()
    assert down.value.retryable and "retryable" in str(down.value)
    polling = concurrent.futures.ThreadPoolExecutor(1).submit(client.status)  # waits for the coordinator
    port = co.address.rsplit(":", 1)[1]
    again = services.start("coordinator", [*FAST, "--port", port], name="coordinator-again")
    assert polling.result(30).mode == pb.SYNC_MODE_ASYNC, "a status call made while it was down rides out the restart"
    client = CoordinatorClient(again.address)
    client.wait_ready(2, timeout=30)
    info = replica.info()
    assert info.state == 1 and info.pending_version == -1, "serving again, the prepared update dropped"
    deadline = time.monotonic() + 30  # the trainer's step is read once it has registered again
    while (status := client.status()).trainer_step != 1:
        assert time.monotonic() < deadline, f"trainer step not learnt: {status.trainer_step}"
        time.sleep(0.1)
    assert status.weight_version == 1, "learnt from the replica, not reset to 0"
    assert replica.info().weight_version == 1, "the prepared version 2 was never committed"
    stream = Stream(client, "after the restart", max_tokens=4, ignore_eos=True)  # it hung here before
    stream.thread.join(30)
    assert not stream.thread.is_alive(), "a request through the new coordinator must not hang"
    assert stream.chunks[-1].finish_reason == 2 and stream.versions() == [1] * len(stream.versions())
    sync = rl_step(client, seed=1)
    assert sync.version == 2 and sync.verified


def test_replica_left_paused_by_a_vanished_coordinator_resumes_after_its_lease(services):
    co, client, trainer, replica = _fleet(services, ["--coordinator-lease", "2"])
    assert rl_step(client, seed=0).version == 1
    _left_mid_sync(trainer, replica)
    co.kill()
    deadline = time.monotonic() + 30
    while (info := replica.info()).state != 1:
        assert time.monotonic() < deadline, f"still {info.state} 30 s after its coordinator vanished"
        time.sleep(0.2)
    assert info.pending_version == -1 and info.weight_version == 1 and info.memory.staging_bytes == 0
    out = replica.complete("on my own", max_tokens=4, ignore_eos=True)[0]
    assert out.finish_reason == "length" and out.max_weight_version == 1


def test_wait_ready_waits_for_a_coordinator_that_starts_late_and_names_one_that_never_answers(services):
    port = free_port()
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout=1)  # each status call gives up after 1 s
    with pytest.raises(TimeoutError, match=f"the coordinator at 127.0.0.1:{port} does not answer"):
        client.wait_ready(0, timeout=2)
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(client.wait_ready, 0, 60)
    time.sleep(2)  # several status calls have given up by now
    services.start("coordinator", [*FAST, "--port", str(port)], name="late")
    assert waiting.result(60) == [], "the wait spans the coordinator's start, not one call's deadline"
