"""A replica dies (os._exit, no cleanup) in the middle of a gloo broadcast to three replicas, real
processes throughout. The broadcast fails for every receiver; the coordinator takes the dead one out
of the rotation and gives the two survivors the update at once, in the same SyncWeights call, over
a new process group; nobody serves a half-updated model; a replacement is caught up before it
takes traffic. The replica that dies runs each engine that stages an update in the replica's own
process (hf; SGLang, whose scheduler loads it after)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import engines, rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences
from rlsync.coordinator.v1 import coordinator_pb2 as pb

DYING = Path(__file__).resolve().parents[1] / "rollout_worker.py"
# The tiny model in 64 KiB buckets is about 29 broadcasts: the first update goes through, the
# second dies about a third of the way.
FAULT = {"RLSYNC_FAULT": "die_after_broadcasts:40"}


@pytest.mark.parametrize("engine", engines("hf", "sglang"))
def test_survivors_get_the_update_without_the_replica_that_died_mid_broadcast(services, engine):
    co = services.start("coordinator", ["--sync-mode", "async", "--force-backend", "gloo", "--lease", "1.5",
                                        "--heartbeat-interval", "0.3"], name="coordinator")
    tr = services.start("trainer", ["--coordinator", co.address, "--bucket-bytes", "65536"], name="trainer")
    replicas = [services.start("rollout", [*rollout_args(engine if i == 0 else "hf"), "--coordinator", co.address,
                                           "--replica-id", f"r{i}"],
                               name=f"r{i}", env=FAULT if i == 0 else None, script=DYING if i == 0 else None)
                for i in range(3)]
    client = CoordinatorClient(co.address)
    client.wait_ready(4)

    first = rl_step(client, 0)
    assert first.version == 1 and first.replicas == 3 and first.backends == {"gloo": 3}
    second = rl_step(client, 1)  # r0 dies mid-broadcast
    assert replicas[0].proc.wait(30) == 9
    assert second.version == 2 and second.replicas == 2 and second.verified, second
    rollouts = [m for m in client.status().members if m.role == pb.ROLE_ROLLOUT]
    assert sorted(m.name for m in rollouts) == ["r1", "r2"] and {m.weight_version for m in rollouts} == {2}
    trainer = TrainerClient(tr.address)
    for p in replicas[1:]:
        assert differences(trainer.checksums(), RolloutClient(p.address).checksums()) == []
    third = rl_step(client, 2)  # the group of two is the one used from now on
    assert third.version == 3 and third.replicas == 2 and third.verified
    back = services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--replica-id", "r0"],
                          name="r0-again")  # (the coordinator's catch-up is the same for every engine)
    client.wait_ready(4)
    assert RolloutClient(back.address).info().weight_version == 3, "caught up before it takes traffic"
