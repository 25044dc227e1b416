"""Delta updates through the whole fleet, real processes: a bf16 trainer with --delta, replicas
over gloo. Twenty GRPO steps each end bit-exact on every replica while sending a fraction of the
bytes; a replica whose held weights went bad gets the buckets it rebuilt wrong again, whole, and
ends bit-exact too; a late joiner gets a full transfer, then deltas with the others."""

from __future__ import annotations

from pathlib import Path

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.common.audit import differences

WORKER = Path(__file__).resolve().parents[1] / "rollout_worker.py"
BF16 = {"dtype": "bfloat16"}


def test_twenty_delta_steps_end_bit_exact_with_a_bad_base_and_a_late_joiner(services):
    co = services.start("coordinator", ["--sync-mode", "async", "--force-backend", "gloo"], name="coordinator")
    on = ["--coordinator", co.address]
    tr = services.start("trainer", [*on, "--delta", "--dtype", "bfloat16", "--lr", "1e-5", "--bucket-bytes",
                                    "65536"], name="trainer")
    good = services.start("rollout", [*rollout_args("hf", **BF16), *on, "--replica-id", "good"], name="good")
    bad = services.start("rollout", [*rollout_args("hf", **BF16), *on, "--replica-id", "bad"], name="bad",
                         script=WORKER, env={"RLSYNC_FAULT": "corrupt_base_at:20"})
    client = CoordinatorClient(co.address)
    client.wait_ready(3)
    trainer = TrainerClient(tr.address)

    def step(seed: int):
        sync = rl_step(client, seed)
        assert sync.verified, (seed, sync)
        return sync

    syncs = [step(i) for i in range(20)]
    assert syncs[0].wire_bytes == syncs[0].bytes, "the first update has no base: it goes whole"
    later = [s.wire_bytes / s.bytes for s in syncs[1:]]
    assert max(later) < 0.5, later  # about 0.33 at the first delta, 0.06 by the twentieth (tiny model, bf16)
    refilled = [i for i, s in enumerate(syncs) if "receiver_refill" in s.transfer_profile]
    assert len(refilled) == 1, "the bucket rebuilt on a bad base was found and sent again whole, once"
    for p in (good, bad):
        assert differences(trainer.checksums(), RolloutClient(p.address).checksums()) == []

    late = services.start("rollout", [*rollout_args("hf", **BF16), *on, "--replica-id", "late"], name="late")
    client.wait_ready(4)
    assert RolloutClient(late.address).info().weight_version == 20, "caught up by a full transfer"
    assert differences(trainer.checksums(), RolloutClient(late.address).checksums()) == []
    after = step(20)
    assert after.replicas == 3 and after.wire_bytes < after.bytes / 2, after  # the three hold one base again
    for p in (good, bad, late):
        assert differences(trainer.checksums(), RolloutClient(p.address).checksums()) == []
