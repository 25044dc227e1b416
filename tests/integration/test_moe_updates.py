"""A mixture of experts (the tiny Qwen3-MoE) kept in step: its trainer holds the experts fused, its
checkpoint and engines name one tensor per expert; updates arrive bit for bit in hf, vLLM and SGLang replicas,
from rlsync's trainer through a coordinator and from a user's own loop through the publisher SDK."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import GREEDY_PROMPT, engines, greedy_against_transformers, rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.models import ensure_tiny_moe
from rlsync.publish import WeightPublisher

# vLLM computes in float32 here so that its audit and its greedy output compare exactly.
STACKED = {"vllm", "hf", "sglang"}  # the engines that take fused experts stacked (WeightFormat.stacked_experts)
ENGINE_EXTRA = {"vllm": {"dtype": "float32"}, "hf": {}, "sglang": {"dtype": "float32"}}


@pytest.fixture(scope="module")
def moe_model():
    return ensure_tiny_moe()


def _fleet(services, moe_model, engine: str, with_trainer: bool, mode: str = "async"):
    """A coordinator (`mode` sync), a replica of `engine` and, if asked, rlsync's trainer, on the tiny MoE."""
    co = services.start("coordinator", ["--sync-mode", mode], name=f"co-moe-{engine}-{mode}")
    trainer = None
    if with_trainer:
        trainer = services.start("trainer", ["--coordinator", co.address, "--model", str(moe_model), "--checksums",
                                   "--lr", "0.01"], name=f"trainer-moe-{engine}-{mode}")
    replica = services.start("rollout", [*rollout_args(engine, **ENGINE_EXTRA[engine]), "--model", str(moe_model),
                                         "--coordinator", co.address], name=f"rollout-moe-{engine}-{mode}", wait=False)
    replica.wait_ready(timeout=360)  # (slow is not dead: a vLLM MoE replica beside two busy lanes took over 180 s)
    client = CoordinatorClient(co.address)
    client.wait_ready(2 if with_trainer else 1)
    return client, RolloutClient(replica.address), TrainerClient(trainer.address) if trainer else None


def test_the_checkpoint_names_one_tensor_per_expert_and_the_model_fuses_them(moe_model):
    with safe_open(str(moe_model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    model = AutoModelForCausalLM.from_pretrained(moe_model)
    assert model.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape == (8, 64, 64)


SGLANG_ASYNC = [pytest.param(*e.values, "async", marks=e.marks) for e in engines("sglang")]


# vLLM async is the TP = 2 test's (below); here in-flight: the commit switches between two engine steps.
@pytest.mark.parametrize("engine, mode", [("hf", "async"), ("vllm", "inflight"), *SGLANG_ASYNC])
def test_five_trainer_steps_arrive_bit_for_bit_and_greedy_tokens_equal_transformers(services, moe_model, engine,
                                                                               mode, tmp_path):
    """Five refits in a row (NeMo-RL's failure was the second: vLLM laid the experts out anew at the first), each
    verified; then the engine computes what transformers does on the trainer's weights, on a prompt it served at
    every version before (an engine's prefix cache may hold that prompt's KV from the old weights: SGLang's radix
    cache did, the RL demo's prompts repeat). On vLLM's CPU build this needs its experts padded and prepacked again
    at each reload (vllm_experts)."""
    client, replica, trainer = _fleet(services, moe_model, engine, with_trainer=True, mode=mode)
    for step in range(1, 6):  # five refits in a row (a second refit is where MoE reloads have failed elsewhere)
        replica.complete(GREEDY_PROMPT, max_tokens=1)  # its prefix cached on version step - 1
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified and sync.replicas == 1
    names = {t.name for t in replica.checksums().tensors}
    stacked = replica.info().weight_format.stacked_experts  # (the fused experts went out whole: one tensor each)
    assert stacked == (engine in STACKED), engine
    assert ("model.layers.1.mlp.experts.gate_up_proj" if stacked else "model.layers.1.mlp.experts.7.up_proj.weight") \
        in names, "the engine is audited under the names it was sent"
    # greedy tokens of the updated engine equal transformers' on the same weights (the trainer's checkpoint)
    got, want = greedy_against_transformers(replica, trainer.save_checkpoint(str(tmp_path / "ckpt")).path)
    assert got == want


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_users_loop_publishes_the_fused_experts(services, moe_model, engine):
    """The issue's user loop: a plain transformers MoE published through the SDK (was refused by vLLM:
    unknown tensor 'model.layers.0.mlp.experts.gate_up_proj'); the replica takes them stacked, and the SDK
    publisher sends them so."""
    client, replica, _ = _fleet(services, moe_model, engine, with_trainer=False)
    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    with WeightPublisher(model, client.address) as pub:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
            sync = pub.publish(step, verify=True)
            assert sync.version == step and sync.verified
    assert replica.info().weight_version == 2



def test_delta_broadcasts_of_the_experts_end_bit_exact_and_send_less(services, moe_model):
    """--delta over gloo: the per-expert views are the resident tensors a delta is taken against."""
    co = services.start("coordinator", ["--sync-mode", "async", "--force-backend", "gloo"], name="co-moe-delta")
    on = ["--coordinator", co.address, "--model", str(moe_model)]
    services.start("trainer", [*on, "--delta", "--dtype", "bfloat16", "--lr", "1e-5", "--bucket-bytes", "65536"],
                   name="trainer-moe-delta")
    services.start("rollout", [*rollout_args("hf", dtype="bfloat16"), *on], name="rollout-moe-delta")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    syncs = [rl_step(client, seed) for seed in range(4)]
    assert all(s.verified for s in syncs)
    assert syncs[0].wire_bytes == syncs[0].bytes and max(s.wire_bytes / s.bytes for s in syncs[1:]) < 0.5


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_colocated_steps_offload_and_onload_the_experts_and_stay_bit_exact(services, moe_model, engine):
    """The colocated sequence moves the trainer's memory every step: its per-expert views are taken again;
    the engine sleeps and wakes around every update (on vLLM's CPU build, sequenced only)."""
    client, replica, _ = _fleet(services, moe_model, engine, with_trainer=True, mode="colocated")
    for step in (1, 2, 3):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified
    assert replica.info().weight_version == 3


def _tp2_share(moe_model) -> tuple[int, int]:
    """(fp32 bytes each of two tensor-parallel vLLM workers loads of the tiny MoE, of them the experts'): every
    matrix split in two (experts' gate/up by rows, down by columns; attention by heads, 2 key/value heads over 2
    ranks; vocabulary by rows) but the router, which every rank holds whole, as it does the norms."""
    with safe_open(str(moe_model / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    numel = {n: int(torch.tensor(s).prod()) for n, s in shapes.items()}
    split = [n for n, s in shapes.items() if len(s) == 2 and not n.endswith("mlp.gate.weight")]
    whole = sum(numel[n] for n in shapes if n not in split)
    experts = sum(numel[n] for n in split if ".mlp.experts." in n)
    return (sum(numel[n] for n in split) // 2 + whole) * 4, experts // 2 * 4


def test_an_fsdp2_trainer_routes_each_tensor_parallel_worker_its_slice_of_every_expert(services, moe_model):
    """--nproc 2 (FSDP2: each trainer rank holds whole experts) into a vLLM replica of TP = 2 beside an hf
    replica, the experts stacked (one tensor per layer and projection; a worker's box of it: every expert's rows
    r): each vLLM worker receives exactly its slice of every expert (and nothing more), five refits in a row are
    verified (from the third on, into the staging the last one kept, its experts laid out where vLLM's loaders put
    them), and the vLLM replica's greedy tokens equal the hf replica's (transformers') after them. The staging kept
    between updates is the replica's spare memory, given back by a sleep."""
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-moe-tp2")
    on = ["--coordinator", co.address, "--model", str(moe_model)]
    services.start("trainer", [*on, "--nproc", "2", "--lr", "0.01"], name="trainer-moe-fsdp2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    tp2 = RolloutClient(services.start("rollout", [*rollout_args("vllm", tensor_parallel_size=2, dtype="float32"),
                                                   *on], env=env, name="rollout-moe-tp2").address)
    hf = RolloutClient(services.start("rollout", [*rollout_args("hf"), *on], name="rollout-moe-hf-beside").address)
    client = CoordinatorClient(co.address)
    client.wait_ready(3)
    for step in range(1, 6):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified and sync.replicas == 2, sync
    share, expert_share = _tp2_share(moe_model)
    info = tp2.info()
    received = list(info.received_bytes)
    assert received == [share, share], f"each worker receives its slice of every tensor: {received} vs {share}"
    assert info.memory.staging_bytes == 0 and info.memory.spare_bytes >= 2 * share, info.memory
    for replica in (tp2, hf):
        names = {t.name for t in replica.checksums().tensors}
        assert "model.layers.1.mlp.experts.gate_up_proj" in names and not any(".experts.7." in n for n in names)
    prompt = hf.complete("the model reads", max_tokens=1)[0].prompt_token_ids
    greedy = [r.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)[0].token_ids for r in (tp2, hf)]
    assert greedy[0] == greedy[1], "vLLM TP = 2 computes what transformers does on the same weights"
    tp2.sleep(level=1)
    assert tp2.info().memory.spare_bytes == 0, "a sleep gives the kept staging back"
    tp2.wake_up()


@pytest.mark.parametrize("engine", engines("sglang"))
def test_an_fsdp2_trainer_refits_an_sglang_replica_bit_for_bit_and_its_greedy_tokens_equal_transformers(
        services, moe_model, engine):
    """--nproc 2 (FSDP2: each trainer rank holds whole experts) routes into an SGLang replica (TP = 1: SGLang's CPU
    path refuses more) beside an hf replica, the experts stacked (its scheduler loads each one's experts' tensors):
    five refits in a row, each verified bit for bit, then SGLang's greedy
    tokens equal the hf replica's (transformers') on the same weights, on a prompt SGLang served at every version
    before (its radix cache kept that prompt's KV from the old weights until each commit started a new cache salt).
    A sharded trainer writes no checkpoint (yet): the hf replica is the reference."""
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-moe-fsdp2-sglang")
    on = ["--coordinator", co.address, "--model", str(moe_model)]
    services.start("trainer", [*on, "--nproc", "2", "--lr", "0.01"], name="trainer-moe-fsdp2-sglang")
    replica = services.start("rollout", [*rollout_args(engine, **ENGINE_EXTRA[engine]), *on],
                             name="rollout-moe-fsdp2-sglang", wait=False)
    hf = RolloutClient(services.start("rollout", [*rollout_args("hf"), *on], name="rollout-moe-hf-by-sglang").address)
    replica.wait_ready(timeout=360)
    sglang = RolloutClient(replica.address)
    client = CoordinatorClient(co.address)
    client.wait_ready(3)
    syncs = []
    for step in range(1, 6):
        sglang.complete(GREEDY_PROMPT, max_tokens=1)  # its prefix cached on version step - 1
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified and sync.replicas == 2, sync
        assert len(sync.trainer_rank_bytes) == 2 and min(sync.trainer_rank_bytes) > 0, "both ranks send (routed)"
        syncs.append((round(sync.seconds, 3), {k: round(v, 3) for k, v in sync.phases.items()}))
    print(f"\n[moe-fsdp2-sglang] five syncs (seconds, phases): {syncs}")
    audited = {t.name for t in sglang.checksums().tensors}  # (under the names sent: stacked, one per projection)
    assert "model.layers.1.mlp.experts.gate_up_proj" in audited and not any(".experts.7." in n for n in audited)
    prompt = sglang.complete(GREEDY_PROMPT, max_tokens=1)[0].prompt_token_ids
    greedy = [r.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)[0].token_ids for r in (sglang, hf)]
    assert greedy[0] == greedy[1], "SGLang computes what transformers does on the trainer's weights"
