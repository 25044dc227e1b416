"""LoRA through the whole fleet, real processes: a trainer with --lora-rank trains a peft adapter on
the frozen tiny model and syncs only the adapter; replicas keep their base resident and serve base +
adapter, tagged with the version, and a checksum audit covers base and adapter."""

from __future__ import annotations

import pytest

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences

RANK = 4


def adapter_bytes(checksums) -> int:
    return sum(4 * t.shape[0] * t.shape[1] for t in checksums.tensors if ".lora_" in t.name)  # float32


@pytest.mark.parametrize("engine", ["hf"])
def test_lora_steps_sync_only_the_adapter(services, engine):
    co = services.start("coordinator", ["--sync-mode", "async"], name="coordinator")
    on = ["--coordinator", co.address]
    tr = services.start("trainer", [*on, "--lora-rank", str(RANK), "--lr", "1e-2"], name="trainer")
    rep = services.start("rollout", [*rollout_args(engine), *on, "--replica-id", "r0"], name="r0")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    trainer = TrainerClient(tr.address)
    syncs = [rl_step(client, seed) for seed in range(3)]
    audit = trainer.checksums()
    assert all(s.verified for s in syncs), syncs
    assert [s.version for s in syncs] == [1, 2, 3]
    assert {s.bytes for s in syncs} == {adapter_bytes(audit)}, syncs
    assert differences(audit, RolloutClient(rep.address).checksums()) == []
