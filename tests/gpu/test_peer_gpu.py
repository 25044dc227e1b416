"""A replica on another GPU of the trainer's host pulls the weights over P2P (GPU machine, 2 GPUs).

The trainer on GPU 0, a replica on GPU 1 that sees only GPU 1: it maps the trainer's memory by IPC
handle anyway (NVLink or PCIe P2P, as NVML reports) and copies it with a copy engine, beside
decoding, with no NCCL group. A second replica on GPU 1 pulls too (NCCL takes no two members on one
GPU); replicas on several other GPUs would take NCCL's broadcast (tests/unit/test_peer_readers.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import rl_step
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
ENGINE = ["--engine", "hf", "--engine-args", json.dumps({"device": "cuda", "dtype": "float32"})]


@pytest.mark.parametrize("mode, buffer", [("async", False), ("inflight", True)])
def test_replicas_on_a_peer_gpu_pull_the_weights(services, mode, buffer):
    co = services.start("coordinator", ["--sync-mode", mode], name="coordinator")
    on = ["--coordinator", co.address]
    tr = services.start("trainer", [*on, "--device", "cuda", "--checksums", *["--publish-buffer"] * buffer],
                        env={"CUDA_VISIBLE_DEVICES": "0"}, name="trainer")
    first = services.start("rollout", [*ENGINE, *on, "--replica-id", "a"], env={"CUDA_VISIBLE_DEVICES": "1"},
                           name="a")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    trainer = TrainerClient(tr.address)
    for seed in range(2):  # the first maps the trainer's memory and holds it, the second finds it held
        sync = rl_step(client, seed)
        assert sync.backends == {"cuda_ipc": 1} and sync.verified, sync
    assert differences(trainer.checksums(), RolloutClient(first.address).checksums()) == []

    second = services.start("rollout", [*ENGINE, *on, "--replica-id", "b"], env={"CUDA_VISIBLE_DEVICES": "1"},
                            name="b")
    client.wait_ready(3)
    sync = rl_step(client, 2)
    assert sync.backends == {"cuda_ipc": 2} and sync.replicas == 2 and sync.verified, sync
    for replica in (first, second):
        assert differences(trainer.checksums(), RolloutClient(replica.address).checksums()) == []
