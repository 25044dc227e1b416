"""LoRA through the whole fleet, real processes: a trainer with --lora-rank trains a peft adapter on
the frozen tiny model and syncs only the adapter; replicas keep their base resident and serve base +
adapter, tagged with the version, and a checksum audit covers base and adapter."""

from __future__ import annotations

import grpc
import pytest
import torch

from conftest import peft_policy, rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient, push_weights, trajectory
from rlsync.client.errors import RpcError
from rlsync.common.audit import differences
from rlsync.transfer.v1 import transfer_pb2 as tpb

RANK = 4


def adapter_bytes(checksums) -> int:
    return sum(4 * t.shape[0] * t.shape[1] for t in checksums.tensors if ".lora_" in t.name)  # float32


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_lora_steps_sync_only_the_adapter(services, engine, tiny_model, tmp_path):
    co = services.start("coordinator", ["--sync-mode", "async"], name="coordinator")
    on = ["--coordinator", co.address]
    tr = services.start("trainer", [*on, "--lora-rank", str(RANK), "--lr", "1e-2"], name="trainer")
    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if engine == "vllm" else {}
    rep = services.start("rollout", [*rollout_args(engine, **lora), *on, "--replica-id", "r0"], name="r0")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    trainer = TrainerClient(tr.address)
    syncs = [rl_step(client, seed) for seed in range(3)]
    audit = trainer.checksums()
    assert all(s.verified for s in syncs), syncs
    assert [s.version for s in syncs] == [1, 2, 3]
    assert {s.bytes for s in syncs} == {adapter_bytes(audit)}, syncs
    assert differences(audit, RolloutClient(rep.address).checksums()) == []

    # The replica serves base + adapter: its sampling logprobs are the trained peft model's.
    done = client.complete("3+4=", n=2, max_tokens=8, temperature=1.0, logprobs=True, seed=7)
    assert {v for c in done for v in c.token_versions} == {3}
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    served = [lp for c in done for lp in c.logprobs]
    trained, base = policy_logprobs(tiny_model, tmp_path / "ckpt", done)
    off_trained = max(abs(a - b) for a, b in zip(served, trained))
    off_base = max(abs(a - b) for a, b in zip(served, base))
    assert off_trained < 1e-2, (served, trained)  # vLLM's CPU build computes this fp32 model in bf16
    assert off_base > 10 * off_trained, "the served policy is the adapted one, not its base"


def policy_logprobs(model_dir, checkpoint, completions) -> tuple[list[float], list[float]]:
    """Logprobs of the completions' tokens under the checkpoint's peft model, and under its base."""
    model = peft_policy(model_dir, checkpoint)

    def logprobs() -> list[float]:
        out = []
        for c in completions:
            lp = torch.log_softmax(model(torch.tensor([c.prompt_token_ids + c.token_ids])).logits[0].float(), -1)
            out += [lp[len(c.prompt_token_ids) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
        return out

    with torch.no_grad():
        trained = logprobs()
        with model.disable_adapter():
            return trained, logprobs()


def test_an_adapter_a_replica_cannot_apply_is_refused_and_it_serves_on(services):
    """A LoRA trainer's offer with a doctored rank, and a vLLM replica started without LoRA support:
    each refused with a precise status before any byte moves; the replica serves on, unchanged."""
    tr = services.start("trainer", ["--lora-rank", str(RANK)], name="trainer")
    hf = RolloutClient(services.start("rollout", rollout_args("hf"), name="hf").address)
    plain = RolloutClient(services.start("rollout", rollout_args("vllm"), name="plain-vllm").address)
    offer = TrainerClient(tr.address).offer_weights().offer
    bad = tpb.Offer()
    bad.CopyFrom(offer)
    bad.manifest.adapter.rank = 2 * RANK
    for replica, offer_, code, words in [(hf, bad, grpc.StatusCode.INVALID_ARGUMENT, f"expected [{2 * RANK}, "),
                                          (plain, offer, grpc.StatusCode.FAILED_PRECONDITION, '"enable_lora": true')]:
        before = replica.complete("stable", max_tokens=8, temperature=0, ignore_eos=True)[0].token_ids
        with pytest.raises(RpcError) as e:
            replica.prepare_update(offer_)
        assert e.value.code == code and words in e.value.message, e.value
        assert replica.info().pending_version == -1 and replica.info().weight_version == 0
        assert replica.complete("stable", max_tokens=8, temperature=0, ignore_eos=True)[0].token_ids == before


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_adapters_and_full_updates_take_turns(services, engine):
    """An adapter, then full weights from another trainer: the adapter is gone from what is served
    and audited. An adapter trained on the checkpoint no longer fits that base: refused with a
    precise status, and the replica serves the full weights on."""
    lora_trainer = TrainerClient(services.start("trainer", ["--lora-rank", str(RANK), "--lr", "5e-2"],
                                                name="lora-trainer").address)
    full_trainer = TrainerClient(services.start("trainer", ["--lr", "1e-2"], name="full-trainer").address)
    args = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if engine == "vllm" else {}
    replica = RolloutClient(services.start("rollout", rollout_args(engine, **args), name="r").address)

    def train(trainer, seed):
        done = replica.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=seed)
        batch = [trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)]
        for t in batch:  # sampled from the other trainer's weights: no versions of this one's
            t.ClearField("token_versions")
        trainer.train(batch)

    for version, trainer in enumerate([lora_trainer, full_trainer], 1):
        train(trainer, version)
        push_weights(trainer, [replica], version=version)
        assert differences(trainer.checksums(), replica.checksums()) == [], version
        done = replica.complete("1+1=", max_tokens=6, temperature=0, ignore_eos=True)[0]
        assert set(done.token_versions) == {version}
    assert not any(".lora_" in t.name for t in replica.checksums().tensors)
    train(lora_trainer, 3)
    with pytest.raises(RpcError) as e:
        push_weights(lora_trainer, [replica], version=3)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "base version 0" in e.value.message, e.value
    assert replica.info().weight_version == 2
    assert differences(full_trainer.checksums(), replica.checksums()) == []
