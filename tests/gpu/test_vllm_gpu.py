"""vLLM's CUDA build (0.20) as the replica's engine, on one GPU beside the trainer, through the services:
vLLM's own sleep mode in the colocated cycle (the update over CUDA IPC straight into the woken weights),
staged updates under the async and in-flight modes while 32 streams generate, a LoRA adapter, and a
replica that dies mid-update. `make gpu-parts` here and `make gpu-setup` there install vLLM (README)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import pytest
import torch

from conftest import rl_step
from rlsync.client import trajectory
from rlsync.client import (AsyncCoordinatorClient, CoordinatorClient, RolloutClient, RpcError, TrainerClient,
                           push_weights)
from rlsync.common.audit import differences, trainer_dtype

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm", reason="vLLM is not installed here: `make gpu-parts` here, `make gpu-setup` there")

DYING = Path(__file__).resolve().parents[1] / "rollout_worker.py"
ON_GPU = {"CUDA_VISIBLE_DEVICES": "0"}
# bf16 weights from the fp32 trainer (cast on arrival); a small fixed KV cache; eager (no compile at start).
VLLM_GPU = {"dtype": "bfloat16", "enable_sleep_mode": True, "enforce_eager": True, "gpu_memory_utilization": 0.15,
            "kv_cache_memory_bytes": 1 << 30, "max_num_seqs": 64}
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def _fleet(services, mode: str, replicas: int = 1, trainer_args=(), engine_extra=None, dying: str = "",
           model: str = "", checksums: bool = True):
    co = services.start("coordinator", ["--sync-mode", mode, "--lease", "3", "--heartbeat-interval", "0.3"],
                        name=f"coordinator-{mode}")
    on = ["--coordinator", co.address, *(["--model", model] if model else [])]
    tr = services.start("trainer", [*on, "--device", "cuda", "--lr", "0.05", *["--checksums"] * checksums,
                                    *trainer_args],
                        env=ON_GPU, name=f"trainer-{mode}")
    engine = ["--engine", "vllm", "--engine-args", json.dumps({**VLLM_GPU, **(engine_extra or {})})]
    ros = []
    for i in range(replicas):
        fault = {"RLSYNC_FAULT": dying} if dying and i == replicas - 1 else {}
        ros.append(services.start("rollout", [*engine, *on, "--replica-id", f"r{i}"], env={**ON_GPU, **fault},
                                  script=DYING if fault else None, name=f"vllm-{mode}-r{i}"))
    client = CoordinatorClient(co.address)
    client.wait_ready(replicas + 1, timeout=600)
    return client, TrainerClient(tr.address), [RolloutClient(r.address) for r in ros], ros


def _same_weights(trainer: TrainerClient, rollout: RolloutClient) -> list[str]:
    served = rollout.checksums()  # live weights in the engine's dtype, or tensors as the trainer sent them
    return differences(trainer.checksums(trainer_dtype(served)), served)


def _logprobs(model, completions) -> list[float]:
    out = []
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([c.prompt_token_ids + c.token_ids], device="cuda")
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            out += [lp[len(c.prompt_token_ids) - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
    return out


def test_colocated_cycles_land_each_update_in_vllms_woken_weights_bit_for_bit(services, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    client, trainer, (rollout,), _ = _fleet(services, "colocated")
    syncs = [rl_step(client, seed) for seed in range(3)]  # sleep, train, wake weights, pull, commit, wake KV
    assert [s.version for s in syncs] == [1, 2, 3] and all(s.verified for s in syncs), syncs
    assert all(s.backends == {"cuda_ipc": 1} for s in syncs), syncs
    assert all("receiver_in_place" in s.transfer_profile for s in syncs), \
        ("straight into the live weights, no staging", [sorted(s.transfer_profile) for s in syncs])
    assert rollout.info().memory.staging_bytes == 0

    # vLLM serves the trained weights (not the ones it slept with): greedy logprobs are the trainer's.
    done = client.complete("3+4=", n=1, max_tokens=12, temperature=0, logprobs=True, ignore_eos=True)
    assert {v for c in done for v in c.token_versions} == {3}
    trainer.onload()  # (the colocated cycle left it offloaded, the replica awake)
    trained = AutoModelForCausalLM.from_pretrained(trainer.save_checkpoint(str(tmp_path / "c")).path,
                                                   torch_dtype=torch.bfloat16).cuda().eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.bfloat16).cuda().eval()
    served = [lp for c in done for lp in c.logprobs]
    off_trained = [abs(a - b) for a, b in zip(served, _logprobs(trained, done))]
    off_base = [abs(a - b) for a, b in zip(served, _logprobs(base, done))]
    # bf16 logits on both sides, from different kernels: a few units in the last place of a logit (~0.03 at 5)
    assert max(off_trained) < 0.1, (served, off_trained)
    assert sum(off_base) > sum(off_trained), "the served policy is the trained one, not the one it slept with"


def test_colocated_updates_after_the_first_are_the_copy_armed_at_the_wake_started_by_the_trainers_bell(services):
    """After a first pull into the woken weights from the storages it holds, the worker queues that pull again
    at each wake of the weights, behind its bell (rlsync_arm); the trainer writes the bell once its weights are
    final, and the replica adopts the copy for the offer with no call into vLLM's engine: each update verified
    bit for bit (no checksums in the manifest: an armed copy repeats bytes it cannot check), vLLM serving the last.
    The trainer holds bf16 parameters, as the engine does: tensors cast on arrival are not one copy to repeat."""
    client, trainer, (rollout,), _ = _fleet(services, "colocated", checksums=False,
                                            trainer_args=("--dtype", "bfloat16"))
    syncs = [rl_step(client, seed) for seed in range(4)]
    assert [s.version for s in syncs] == [1, 2, 3, 4] and all(s.verified for s in syncs), syncs
    assert ["receiver_adopt" in s.transfer_profile for s in syncs] == [False, True, True, True], \
        [sorted(s.transfer_profile) for s in syncs]
    greedy = {"n": 1, "max_tokens": 8, "temperature": 0, "logprobs": True, "ignore_eos": True}
    before = rollout.complete("3+4=", **greedy)
    assert {v for c in before for v in c.token_versions} == {4}

    # A train step without a sync (the trainer's weights move on), then a wake of the weights arms the copy again
    # and a wake of the KV cache with no update withdraws it: emptied before any bell, it moves nothing, and the
    # replica serves version 4's weights as they were.
    done = client.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=9)
    client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])  # (sleeps it)
    rollout.wake_up("weights")
    rollout.wake_up("kv_cache")
    after = rollout.complete("3+4=", **greedy)
    assert [c.token_ids for c in after] == [c.token_ids for c in before] and \
        [c.logprobs for c in after] == [c.logprobs for c in before], "the withdrawn copy wrote nothing"
    sync = client.sync_weights(verify=True)  # then the next sync lands (staged: the KV cache is awake) and verifies
    assert sync.version == 5 and sync.verified, sync
    trainer.onload()  # (the cycle left it offloaded)
    assert _same_weights(trainer, rollout) == []


@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_vllm_serves_an_fp8_checkpoint_and_each_update_arrives_quantized_bit_for_bit(services, mode, tmp_path):
    """vLLM's Fp8LinearMethod (block scales, on the GPU) holds the checkpoint's FP8 weights; the replica says so
    (RolloutInfo.weight_format), the bf16 trainer quantizes on the way out, vLLM's layerwise reload takes the
    FP8 values and scales, and it then computes with the trained weights."""
    from safetensors.torch import load_file

    from rlsync.models import ensure_tiny_fp8, load_trainable
    from rlsync.quant.fp8_blocks import quantize_blocks
    from rlsync.quant.fp8_format import scale_name
    from rlsync.transfer import audit_entry

    fp8 = str(ensure_tiny_fp8())
    client, trainer, (rollout,), _ = _fleet(services, mode, model=fp8, trainer_args=("--dtype", "bfloat16"))
    fmt = rollout.info().weight_format.fp8  # from the checkpoint (its config and its scales), not a hand list
    assert list(fmt.block) == [128, 128] and fmt.fmt == "e4m3" and len(fmt.weights) == 14, fmt
    syncs = [rl_step(client, seed) for seed in range(2)]
    assert [s.version for s in syncs] == [1, 2] and all(s.verified for s in syncs), syncs
    assert all(s.backends == {"cuda_ipc": 1} for s in syncs), syncs

    if mode == "colocated":
        trainer.onload()  # (the cycle left it offloaded)
    checkpoint = trainer.save_checkpoint(str(tmp_path / "c")).path
    trained = load_file(f"{checkpoint}/model.safetensors")
    served = {t.name: t for t in rollout.checksums().tensors}
    want = {}
    for w in fmt.weights:  # the reference quantizer on the GPU (its arithmetic: rlsync.quant.fp8_blocks)
        q, scale = quantize_blocks(trained[w].cuda())
        want[w], want[scale_name(w)] = audit_entry(q.cpu())[2], audit_entry(scale.cpu())[2]
    assert {n: served[n].checksum for n in want} == want  # values and scales, bit for bit
    fp8_bytes = sum(t.nbytes // 2 + 4 * -(-t.shape[0] // 128) * -(-t.shape[1] // 128) if n in fmt.weights
                    else t.nbytes for n, t in trained.items())
    assert syncs[-1].bytes == fp8_bytes < sum(t.nbytes for t in trained.values())

    done = client.complete("3+4=", n=1, max_tokens=12, temperature=0, logprobs=True, ignore_eos=True)
    assert {v for c in done for v in c.token_versions} == {2}
    served_lp = [lp for c in done for lp in c.logprobs]
    off = {}
    for name, path in (("trained", checkpoint), ("base", fp8)):
        model = load_trainable(path, "bfloat16").cuda().eval()  # (the base: its FP8 weights dequantized)
        off[name] = [abs(a - b) for a, b in zip(served_lp, _logprobs(model, done))]
    print(f"\nvLLM FP8 ({mode}) vs the bf16 trainer, greedy logprobs over 12 tokens: mean gap "
          f"{sum(off['trained']) / 12:.4f} (vs the base weights {sum(off['base']) / 12:.4f}) nats; "
          f"{syncs[-1].bytes} bytes a sync")
    assert sum(off["base"]) > sum(off["trained"]), ("it computes with the trained weights, not the loaded ones", off)


@pytest.mark.parametrize("mode", ["colocated", "inflight"])
def test_a_mixture_of_experts_refits_five_times_bit_for_bit_and_vllm_computes_with_the_trained_experts(
        services, mode, tmp_path):
    """The tiny Qwen3-MoE on vLLM's GPU build: the fp32 trainer's fused experts ([E, 2I, H]) sent stacked (one
    tensor per layer and projection) over CUDA IPC, into vLLM's fused w13 / w2 (straight into the woken weights when
    colocated, staged and committed between two engine steps in flight); five refits in a row verified bit for
    bit (a second refit is where vLLM's relayout of MoE weights at first load has broken others), then vLLM's
    greedy logprobs follow the trained experts."""
    from rlsync.models import ensure_tiny_moe, load_trainable

    moe = str(ensure_tiny_moe())
    client, trainer, (rollout,), _ = _fleet(services, mode, model=moe)
    syncs = [rl_step(client, seed) for seed in range(5)]
    assert [s.version for s in syncs] == [1, 2, 3, 4, 5] and all(s.verified for s in syncs), syncs
    assert all(s.backends == {"cuda_ipc": 1} for s in syncs), syncs
    served = {t.name for t in rollout.checksums().tensors}
    assert "model.layers.1.mlp.experts.down_proj" in served, "audited under the names sent: stacked"

    if mode == "colocated":
        trainer.onload()  # (the cycle left it offloaded)
    checkpoint = trainer.save_checkpoint(str(tmp_path / "c")).path
    assert _same_weights(trainer, rollout) == []
    done = client.complete("3+4=", n=1, max_tokens=12, temperature=0, logprobs=True, ignore_eos=True)
    assert {v for c in done for v in c.token_versions} == {5}
    served_lp = [lp for c in done for lp in c.logprobs]
    off = {}
    for name, path in (("trained", checkpoint), ("base", moe)):
        model = load_trainable(path, "bfloat16").cuda().eval()
        off[name] = [abs(a - b) for a, b in zip(served_lp, _logprobs(model, done))]
    # bf16 on both sides, other kernels (vLLM's fused MoE, transformers'): a router whose top-2 is near a tie may
    # pick another expert on one side, so the median, not every token
    assert sorted(off["trained"])[len(off["trained"]) // 2] < 0.1, off
    assert sum(off["base"]) > sum(off["trained"]), ("it computes with the trained experts, not the loaded ones", off)


def test_an_update_into_the_woken_weights_that_is_abandoned_leaves_them_unserved_until_the_next(services):
    trainer = TrainerClient(services.start("trainer", ["--device", "cuda", "--lr", "0.05", "--checksums"],
                                           env=ON_GPU, name="trainer-abandoned").address)
    rollout = RolloutClient(services.start("rollout", ["--engine", "vllm", "--engine-args", json.dumps(VLLM_GPU)],
                                           env=ON_GPU, name="vllm-abandoned").address)
    rollout.sleep(level=1)
    rollout.wake_up("weights")
    offer = trainer.offer_weights(version=1, pull=True).offer  # the replica pulls it into the weights as it prepares
    rollout.prepare_update(offer)
    rollout.abort_update()  # whole but never committed: not version 0's weights any more, not version 1 either
    rollout.wake_up("kv_cache")
    with pytest.raises(RpcError) as e:
        rollout.complete("x", max_tokens=4)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "half-written" in e.value.message
    assert rollout.info().weight_version == 0
    report = push_weights(trainer, [rollout], version=2, pull=True)  # awake: staged, then reloaded
    assert report.backends == {"cuda_ipc": 1}
    assert rollout.complete("x", max_tokens=4, ignore_eos=True)[0].token_versions == [2] * 4
    assert _same_weights(trainer, rollout) == []


def test_a_worker_that_cannot_map_the_trainers_memory_receives_over_another_channel_and_says_so(services):
    trainer = TrainerClient(services.start("trainer", ["--device", "cuda", "--lr", "0.05", "--checksums"],
                                           env=ON_GPU, name="trainer-unmappable").address)
    unmappable = {**VLLM_GPU, "worker_extension_cls": "vllm_unmappable.UnmappableExtension"}
    path = ":".join(filter(None, [str(DYING.parent), os.environ.get("PYTHONPATH")]))
    proc = services.start("rollout", ["--engine", "vllm", "--engine-args", json.dumps(unmappable)],
                          env={**ON_GPU, "PYTHONPATH": path}, name="vllm-unmappable")
    rollout = RolloutClient(proc.address)
    for version in (1, 2):  # the second is answered without cuda_ipc from the start
        report = push_weights(trainer, [rollout], version=version, pull=True)
        assert report.backends == {"shm": 1}, report
        assert _same_weights(trainer, rollout) == []
    assert rollout.complete("x", max_tokens=4, ignore_eos=True)[0].token_versions == [2] * 4
    log = proc.log_path.read_text()
    assert log.count("cannot map the sender's CUDA memory") == 1 and "comes over shm instead" in log, log[-3000:]


@pytest.mark.parametrize("mode", ["async", "inflight"])
def test_updates_while_32_streams_generate_lose_nothing(services, mode):
    client, trainer, (rollout,), _ = _fleet(services, mode)
    streams, tokens = 32, 96

    async def run():
        async with AsyncCoordinatorClient(client.address, timeout=None) as gc:
            async def one(i):
                chunks = [c async for c in gc.generate(f"stream {i}", max_tokens=tokens, ignore_eos=True, seed=i)]
                return chunks

            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            loop = asyncio.get_running_loop()
            syncs = []
            for seed in range(3):
                await asyncio.sleep(0.3)
                syncs.append(await loop.run_in_executor(None, rl_step, client, seed))
            return syncs, await asyncio.gather(*tasks)

    syncs, results = asyncio.run(run())
    assert [s.version for s in syncs] == [1, 2, 3] and all(s.verified for s in syncs), syncs
    for chunks in results:
        final = chunks[-1]
        assert final.finish_reason == 2 and sum(len(c.token_ids) for c in chunks) == tokens, "nothing lost"
        assert sum(s.length for s in final.version_spans) == tokens
        versions = [s.weight_version for s in final.version_spans]
        assert versions == sorted(versions)
    status = client.status()
    if mode == "inflight":
        assert status.resubmissions == 0, "in-flight updates abort nothing"
    assert _same_weights(trainer, rollout) == []


def test_a_lora_adapter_syncs_alone_into_vllm(services):
    client, trainer, (rollout,), _ = _fleet(services, "async", trainer_args=["--lora-rank", "4"], engine_extra=LORA)
    syncs = [rl_step(client, seed) for seed in range(2)]
    assert all(s.verified for s in syncs) and [s.version for s in syncs] == [1, 2], syncs
    audit = trainer.checksums()
    adapter = sum(4 * t.shape[0] * t.shape[1] for t in audit.tensors if ".lora_" in t.name)
    assert {s.bytes for s in syncs} == {adapter}, "only the adapter moves"
    done = client.complete("3+4=", n=2, max_tokens=8, temperature=1.0, logprobs=True, seed=7)
    assert {v for c in done for v in c.token_versions} == {2}


def test_a_replica_that_dies_mid_update_leaves_the_other_updated_and_none_half_updated(services):
    client, trainer, (survivor, _), procs = _fleet(services, "colocated", replicas=2, dying="die_in_prepare:1")
    first = rl_step(client, 0)
    assert first.version == 1 and first.replicas == 2 and first.verified, first
    second = rl_step(client, 1)  # r1 dies once its second update's bytes landed, before it answers
    assert procs[1].proc.wait(120) == 9
    assert second.version == 2 and second.replicas == 1 and second.verified, second  # (trainer offloaded now)
    assert survivor.info().weight_version == 2
    done = client.complete("after", max_tokens=8, ignore_eos=True)
    assert {v for c in done for v in c.token_versions} == {2}, "served by the survivor, on the new version"
