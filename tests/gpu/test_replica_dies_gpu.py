"""A replica dies (os._exit, no cleanup) in the middle of an NCCL broadcast, real processes on two
GPUs: the trainer on GPU 0 with a colocated replica (cuda_ipc), the dying one on GPU 1 (nccl). The
watchdog aborts the NCCL group instead of hanging on it, the survivor gets the update in the same
SyncWeights call, and a replacement on GPU 1 is caught up over a new NCCL group before it takes
traffic. The CPU twin (gloo, three receivers) is tests/integration/test_replica_dies_mid_update.py;
NCCL refuses two ranks on one GPU, so two GPUs hold one NCCL receiver."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import rl_step
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
DYING = Path(__file__).resolve().parents[1] / "rollout_worker.py"
ENGINE = ["--engine", "hf", "--engine-args", json.dumps({"device": "cuda", "dtype": "float32"})]
# The tiny model in 64 KiB buckets is about 29 broadcasts: the first update goes through, the
# second dies about a third of the way.
# The replica on GPU 1 maps nothing over P2P: it takes NCCL (the one replica across GPUs would pull,
# tests/gpu/test_peer_gpu.py).
FAR = {"CUDA_VISIBLE_DEVICES": "1", "RLSYNC_PEER_PULLS": "0"}
FAULT = {"RLSYNC_FAULT": "die_after_broadcasts:40", **FAR}


def test_nccl_receiver_dies_mid_broadcast_and_the_fleet_carries_on(services):
    co = services.start("coordinator", ["--sync-mode", "async", "--lease", "1.5", "--heartbeat-interval", "0.3"],
                        name="coordinator")
    on = ["--coordinator", co.address]
    tr = services.start("trainer", [*on, "--device", "cuda", "--bucket-bytes", "65536", "--checksums"],
                        env={"CUDA_VISIBLE_DEVICES": "0"}, name="trainer")
    dying = services.start("rollout", [*ENGINE, *on, "--replica-id", "far"], env=FAULT, script=DYING, name="far")
    near = services.start("rollout", [*ENGINE, *on, "--replica-id", "near"], env={"CUDA_VISIBLE_DEVICES": "0"},
                          name="near")
    client = CoordinatorClient(co.address)
    client.wait_ready(3)

    first = rl_step(client, 0)
    assert first.version == 1 and first.backends == {"nccl": 1, "cuda_ipc": 1}, first
    second = rl_step(client, 1)  # "far" dies mid-broadcast
    assert dying.proc.wait(60) == 9
    assert second.version == 2 and second.replicas == 1 and second.verified, second
    trainer = TrainerClient(tr.address)
    assert differences(trainer.checksums(), RolloutClient(near.address).checksums()) == []
    back = services.start("rollout", [*ENGINE, *on, "--replica-id", "far"], env=FAR,
                          name="far-again")
    client.wait_ready(3)
    again = RolloutClient(back.address)
    assert again.info().weight_version == 2, "caught up (over a new NCCL group) before it takes traffic"
    assert differences(trainer.checksums(), again.checksums()) == []
    third = rl_step(client, 2)  # both again, the NCCL group rebuilt for the new process
    assert third.version == 3 and third.replicas == 2 and third.verified and third.backends["nccl"] == 1, third
