"""One coordinator over replicas of both real engines: a vLLM replica and an SGLang replica take the
same sync, are verified against the trainer, and serve the new version."""

from __future__ import annotations

import pytest

from conftest import NEEDS_SGLANG, rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient

# Two engines' starts side by side on a loaded 2-core machine (CI's third lane, beside two others): one took
# more than the default 300 s on CI's machine when they were started one after the other.
pytestmark = [NEEDS_SGLANG, pytest.mark.sglang, pytest.mark.timeout(600)]


def test_one_sync_reaches_a_vllm_and_an_sglang_replica_both_verified(services):
    co = services.start("coordinator", ["--sync-mode", "async"], name="coordinator")
    services.start("trainer", ["--coordinator", co.address, "--checksums"], name="trainer")
    replicas = [services.start("rollout", [*rollout_args(engine, dtype="float32"), "--coordinator", co.address,
                                           "--replica-id", engine], name=engine, wait=False)
                for engine in ("vllm", "sglang")]
    for proc in replicas:  # both load at once
        proc.wait_ready()
    client = CoordinatorClient(co.address)
    client.wait_ready(3)
    for step in (1, 2):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.replicas == 2 and sync.verified, sync
    for proc in replicas:
        rollout = RolloutClient(proc.address)
        assert rollout.info().weight_version == 2
        done = rollout.complete("after", max_tokens=6, ignore_eos=True)[0]
        assert set(done.token_versions) == {2}
