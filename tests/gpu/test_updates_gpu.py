"""Weight updates on the GPU: trainer and hf replica share a GPU (cuda_ipc, one copy), or not (nccl)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import peft_policy, rl_step
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient, push_weights, trajectory
from rlsync.common.audit import differences
from rlsync.models import ensure_tiny_fp8

pytestmark = pytest.mark.gpu
GPU_ENGINE = json.dumps({"device": "cuda", "dtype": "float32"})


def _fleet(services, trainer_gpu: str, replica_gpu: str, checksums: bool = True, trainer_extra=(), engine=GPU_ENGINE):
    tr = services.start("trainer", ["--device", "cuda", "--lr", "0.01", *trainer_extra] + ["--checksums"] * checksums,
                        env={"CUDA_VISIBLE_DEVICES": trainer_gpu}, name="gpu-trainer")
    ro = services.start("rollout", ["--engine", "hf", "--engine-args", engine],
                        env={"CUDA_VISIBLE_DEVICES": replica_gpu}, name="gpu-rollout")
    return TrainerClient(tr.address), RolloutClient(ro.address)


def _check(trainer: TrainerClient, rollout: RolloutClient, backend: str, tmp_path) -> None:
    done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=1)
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    report = push_weights(trainer, [rollout], pull=True)  # nothing trains meanwhile
    assert report.backends == {backend: 1}
    # On the trainer's GPU the replica pulls the bytes while it prepares: no publish round trip.
    assert ("rpc" in report.profile) is (backend != "cuda_ipc")
    assert differences(trainer.checksums(), rollout.checksums()) == []
    model = AutoModelForCausalLM.from_pretrained(trainer.save_checkpoint(str(tmp_path / "c")).path).cuda().eval()
    prompt = done[0].prompt_token_ids
    want = model.generate(torch.tensor([prompt]).cuda(), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert rollout.complete(prompt, max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids == want


def test_same_gpu_update_over_cuda_ipc(services, tmp_path):
    _check(*_fleet(services, "0", "0"), "cuda_ipc", tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_other_gpu_update_over_nccl(services, tmp_path):
    _check(*_fleet(services, "0", "1"), "nccl", tmp_path)


def test_sleep_frees_gpu_memory_and_wake_restores(services):
    ro = services.start("rollout", ["--engine", "hf", "--engine-args", GPU_ENGINE], env={"CUDA_VISIBLE_DEVICES": "0"},
                        name="gpu-sleeper")
    r = RolloutClient(ro.address)
    before = r.complete("sleep", max_tokens=12, temperature=0, ignore_eos=True)[0].token_ids
    awake = r.info().memory
    asleep = r.sleep(level=1).memory
    assert asleep.weights_bytes == 0 and asleep.device_reserved_bytes < awake.device_reserved_bytes
    r.wake_up()
    assert r.complete("sleep", max_tokens=12, temperature=0, ignore_eos=True)[0].token_ids == before


def test_colocated_update_lands_in_the_woken_weights_and_a_failed_one_keeps_the_old(services, tmp_path):
    trainer, rollout = _fleet(services, "0", "0")
    before = rollout.complete("keep", max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids
    # A failed update while asleep-then-woken: the weights come back from the host backup.
    rollout.sleep(level=1)
    rollout.wake_up("weights")
    offer = trainer.offer_weights(version=1).offer  # pushed: the replica waits for a publish that never comes
    rollout.prepare_update(offer)
    rollout.abort_update()
    rollout.wake_up()
    assert rollout.complete("keep", max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids == before
    assert rollout.info().weight_version == 0
    # The colocated order: sleep, wake weights, update (straight into them), wake the KV cache.
    done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=2)
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    rollout.sleep(level=1)
    rollout.wake_up("weights")
    report = push_weights(trainer, [rollout], pull=True)
    rollout.wake_up("kv_cache")
    assert report.backends == {"cuda_ipc": 1} and rollout.info().weight_version == report.version
    assert differences(trainer.checksums(), rollout.checksums()) == []


def test_a_replica_holds_the_trainers_weights_mapped_from_onload_to_offload(services):
    trainer, rollout = _fleet(services, "0", "0")
    bell = rollout.info().doorbell
    done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=3)
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    freed = trainer.offload().state.device_reserved_bytes  # what an offload leaves when nobody maps the weights
    rollout.sleep(level=1)
    assert trainer.onload(ring=[bell]).held == 1  # mapped by the sleeping replica while the trainer trains
    # The offer names the storages the replica holds: holding them again maps nothing.
    offer = trainer.offer_weights(pull=True).offer
    again = rollout.hold_weights("trainer", offer.mapped, offer.facts)
    assert (again.mapped, again.held) == (0, 1)
    rollout.wake_up("weights")
    report = push_weights(trainer, [rollout], pull=True, doorbells=[bell])
    assert report.backends == {"cuda_ipc": 1} and "prepare_ring" in report.profile
    # Holding the memory, the replica answered once its copy was queued; the trainer waited for it
    # on the replica's CUDA event before the update counted as prepared.
    assert {"receiver_queue", "receiver_copied"} <= set(report.profile) and "receiver_copy" not in report.profile
    assert differences(trainer.checksums(), rollout.checksums()) == []
    # The trainer has the replica let go before it offloads: its memory really leaves the GPU.
    off = trainer.offload()
    assert off.released == 1 and off.state.device_reserved_bytes <= freed, (off, freed)
    assert rollout.release_weights("trainer").released == 0
    rollout.wake_up("kv_cache")
    assert rollout.complete("3+4=", max_tokens=4, temperature=0)[0].max_weight_version == report.version


def test_a_replica_on_the_trainers_gpu_holds_its_weights_from_the_first_pushed_update(services):
    """Async and in-flight updates ring the replicas on the trainer's host with the offer: the first has
    the one on its GPU map the trainer's storages and keep them (HoldWeights), later ones map nothing;
    the trainer's Offload has it let go."""
    trainer, rollout = _fleet(services, "0", "0")
    bell = rollout.info().doorbell
    for seed in (4, 5):
        done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
        trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # pushed, as async and inflight
        assert report.backends == {"cuda_ipc": 1} and "rpc" in report.profile
        assert differences(trainer.checksums(), rollout.checksums()) == []
    offer = trainer.offer_weights(pull=True).offer
    again = rollout.hold_weights("trainer", offer.mapped, offer.facts)
    assert (again.mapped, again.held) == (0, 1), "held since the first update: nothing to map"
    off = trainer.offload()
    assert off.released == 1
    assert rollout.release_weights("trainer").released == 0


def test_a_trainer_with_a_publish_buffer_is_pulled_from_while_it_trains(services):
    """Async and in-flight updates do not keep the trainer still: with a publish buffer, the offer copies
    the weights into it and a replica on the trainer's GPU pulls that copy (held mapped from the first
    update on), with no publish; a training step after the offer does not reach what the replica gets.
    From the second update on, the replica launches the first pull's copy again as its prepare begins
    (no receiver laid out), into each of its two stores in turn."""
    trainer, rollout = _fleet(services, "0", "0", checksums=False, trainer_extra=["--publish-buffer"])
    bell = rollout.info().doorbell

    def train(seed: int) -> None:
        done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
        trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])

    launched = []
    for seed in (6, 7, 9):
        train(seed)
        report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # as async and inflight: no pull asked
        assert report.backends == {"cuda_ipc": 1} and "rpc" not in report.profile, report.profile
        assert differences(trainer.checksums(), rollout.checksums()) == []
        launched.append("receiver_launch" in report.profile and "receiver_setup" not in report.profile)
    assert launched == [False, True, True], launched
    # A launched update dropped before its commit: the replica serves on, and the next one lands whole.
    served = rollout.checksums()
    train(10)
    rung = trainer.offer_weights(ring=[bell], hold=True).rung[0]
    assert rung.rung and "launch" in rung.answer.stages, rung
    rollout.abort_update()
    assert differences(served, rollout.checksums()) == []
    report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)
    assert differences(trainer.checksums(), rollout.checksums()) == []
    offer = trainer.offer_weights().offer
    offered = trainer.checksums()
    assert offer.mapped.ipc, "an offer of the buffer is a pull"
    train(8)  # the trainer moves on before the replica copies
    assert differences(offered, trainer.checksums()) != []
    rollout.prepare_update(offer)
    rollout.commit_update(offer.manifest.version)
    assert differences(offered, rollout.checksums()) == []
    assert trainer.offload().released == 1  # the buffer was held; the offload has it let go


def test_a_replica_arming_while_it_generates_adopts_each_copy_the_trainers_bell_started(services):
    """arm_while_generating: each commit queues the next pull into the spare weights behind a bell in host memory,
    while streams go on generating; the trainer (with a publish buffer, held from the first update) writes that
    bell with each offer, and the next prepare adopts the copy already running: every update lands whole (the
    trainer's checksums), and generation never stops (each stream ends with all its tokens)."""
    # (patience of 2 s: the trainer's steps on the same GPU slow the replica's beside them, which with the usual
    # patience could let every copy go; a first launch behind a copy still waits for it, 2 s at most)
    engine = json.dumps({**json.loads(GPU_ENGINE), "arm_while_generating": True, "arm_patience_ms": 2000})
    trainer, rollout = _fleet(services, "0", "0", checksums=False, trainer_extra=["--publish-buffer"], engine=engine)
    bell = rollout.info().doorbell
    stop, ended = threading.Event(), []

    def stream(seed: int) -> None:
        while not stop.is_set():
            done = rollout.complete("count:", max_tokens=64, ignore_eos=True, seed=seed)
            ended.append(len(done[0].token_ids))

    streams = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in streams:
        t.start()
    rollout.checksums()  # (the audit's kernel loaded before anything waits behind a bell: a first launch would let
    time.sleep(3)  # the copy go, as would the batch's first shapes)
    adopted = []
    try:
        for seed in (6, 7, 9, 11):
            done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
            trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
            report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # as inflight
            assert report.backends == {"cuda_ipc": 1}
            assert differences(trainer.checksums(), rollout.checksums()) == []
            adopted.append("receiver_adopt" in report.profile)
    finally:
        stop.set()
        for t in streams:
            t.join(120)
    # The first pull teaches what to arm; later ones adopt the copy unless a step that ran far longer than usual
    # (a kernel's first launch: a batch shape not seen before) let it go, and then launch it as they prepare.
    assert not adopted[0] and any(adopted[1:]), adopted
    assert ended and set(ended) == {64}
    assert trainer.offload().released == 1


def test_a_replica_arms_its_next_pull_at_wake_and_the_trainers_bell_starts_it(services, tmp_path):
    """The colocated cycle with holds, three times: the first pull teaches the replica what to copy;
    from then on its wake queues that copy behind its bell, the trainer's ring starts it on the GPU,
    and the prepare adopts it. A wake whose update never comes is disarmed: the replica serves what
    it served before, and sleeps again without waiting forever. (No per-tensor checksums in the
    manifest: they change with every version, so a replica never arms for one.)"""
    trainer, rollout = _fleet(services, "0", "0", checksums=False)
    bell = rollout.info().doorbell
    trainer.offload()
    stages = []
    for seed in range(3):
        done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
        rollout.sleep(level=1)
        trainer.onload(ring=[bell])
        trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        rollout.wake_up("weights")
        report = push_weights(trainer, [rollout], pull=True, doorbells=[bell])
        assert differences(trainer.checksums(), rollout.checksums()) == []
        trainer.offload()
        rollout.wake_up("kv_cache")
        stages.append(set(report.profile))
    assert "receiver_queue" in stages[0] and "receiver_adopt" not in stages[0]  # learnt from this pull
    assert all("receiver_adopt" in s and "receiver_copied" in s and "receiver_queue" not in s for s in stages[1:])
    # Armed at a wake, then no update: the armed copy is let go, the backup refills the weights.
    before = rollout.complete("keep", max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids
    rollout.sleep(level=1)
    trainer.onload(ring=[bell])
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
    rollout.wake_up("weights")
    rollout.wake_up("kv_cache")
    assert rollout.complete("keep", max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids == before
    rollout.wake_up("weights")  # nothing to arm: the weights are awake
    rollout.sleep(level=1)
    trainer.offload()
    rollout.wake_up("weights")  # nothing armed: the trainer's offload ended the hold
    rollout.wake_up("kv_cache")
    assert rollout.complete("keep", max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids == before


def test_same_gpu_lora_adapter_over_cuda_ipc(services, tmp_path, tiny_model):
    """A LoRA trainer on the replica's GPU: only the adapter moves (the replica pulls it), base and
    adapter audit equal, and the replica decodes exactly as the trained peft model does."""
    tr = services.start("trainer", ["--device", "cuda", "--lr", "0.05", "--lora-rank", "8"],
                        env={"CUDA_VISIBLE_DEVICES": "0"}, name="gpu-lora-trainer")
    ro = services.start("rollout", ["--engine", "hf", "--engine-args", GPU_ENGINE], env={"CUDA_VISIBLE_DEVICES": "0"},
                        name="gpu-lora-rollout")
    trainer, rollout = TrainerClient(tr.address), RolloutClient(ro.address)
    for seed in range(2):
        done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
        trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        report = push_weights(trainer, [rollout], pull=True)
        assert report.backends == {"cuda_ipc": 1}
    audit = trainer.checksums()
    assert report.bytes == sum(4 * t.shape[0] * t.shape[1] for t in audit.tensors if ".lora_" in t.name)
    assert differences(audit, rollout.checksums()) == []
    model = peft_policy(tiny_model, trainer.save_checkpoint(str(tmp_path / "c")).path).cuda().eval()
    prompt = done[0].prompt_token_ids
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([prompt]).cuda(), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert rollout.complete(prompt, max_tokens=10, temperature=0, ignore_eos=True)[0].token_ids == want


def test_a_sharded_trainer_sharing_the_gpu_is_pulled_from_held_until_its_offload(services):
    """rlsync's trainer with --nproc 2 on one GPU (FSDP2 over gloo: NCCL takes no two ranks on one GPU). A
    replica on that GPU pulls each rank's shards (routed, cuda_ipc); rung with the offer, it keeps them mapped
    from the first update (Routing.holder), or from the trainer's onload when rung then, and the trainer's
    Offload has it let go, so the trainer's memory really leaves the GPU. Holding them, it copies a rung offer
    as it prepares (the offer names every rank's memory: Routing.memories), and nothing is published; into a
    spare store that took such a copy of the same memories before, it launches that copy again before it answers
    (rlsync.transfer.relaunch). Every update verified bit for bit; one prepared by gRPC (no holder) maps anew."""
    trainer, rollout = _fleet(services, "0", "0", checksums=False, trainer_extra=["--nproc", "2"])
    bell = rollout.info().doorbell

    def step(seed: int) -> None:
        done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
        trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])

    step(3)
    report = push_weights(trainer, [rollout])  # prepared by gRPC: mapped and closed within the update
    assert set(report.backends) == {"cuda_ipc"}, report.backends
    assert differences(trainer.checksums(), rollout.checksums()) == []
    assert rollout.release_weights("trainer").released == 0, "nothing held without the holder's name"
    freed = trainer.offload().state.device_reserved_bytes  # what an offload leaves when nobody maps the weights
    trainer.onload()
    for seed in (4, 5, 6, 7):
        step(seed)
        report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # rung, as async and inflight are
        assert differences(trainer.checksums(), rollout.checksums()) == []
        # once it holds every rank's storages, the offer names their memories and it copies as it prepares:
        # answered as a pull, with no publish (no rank sends anything)
        assert (report.rank_bytes == []) == (seed > 4), (seed, report.rank_bytes, report.profile)
        if seed == 7:  # into the spare store that took seed 5's copy: its launch again, before the answer
            assert "receiver_launch" in report.profile, report.profile
    off = trainer.offload()
    assert off.released == 1, "the replica let go"
    assert off.state.device_reserved_bytes <= freed, (off, freed)
    assert rollout.release_weights("trainer").released == 0
    onloaded = trainer.onload(ring=[bell])  # rank 0 gathers every rank's storages: the replica maps them now
    assert onloaded.held == 1, onloaded
    step(8)
    report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # it copies from what it mapped then
    assert differences(trainer.checksums(), rollout.checksums()) == []
    assert report.rank_bytes == [], report.profile
    # made in its spare store as the onload named the new memories (Arming.rearm): launched before the answer
    assert "receiver_launch" in report.profile, report.profile
    step(9)  # then as the colocated cycle does: asleep while the trainer trains, the weights woken for the update
    rollout.sleep(level=1)
    rollout.wake_up("weights")
    report = push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # received in place, into the woken weights
    rollout.wake_up("kv_cache")
    assert differences(trainer.checksums(), rollout.checksums()) == []
    # made in the woken weights at the wake (Arming.rearm) and queued behind the bell there (Arming.arm_routed): the
    # trainer's ring started it, and the prepare adopted it
    assert report.rank_bytes == [] and "receiver_adopt" in report.profile, report.profile
    assert "receiver_launch" not in report.profile, report.profile
    # armed at a wake whose update never comes: let go (the copy runs, from the trainer's newer weights), and the
    # backup refills the weights it ran into
    served = rollout.checksums()
    step(10)
    rollout.sleep(level=1)
    rollout.wake_up("weights")
    rollout.wake_up("kv_cache")
    assert differences(served, rollout.checksums()) == []
    assert differences(trainer.checksums(), rollout.checksums()) != [], "the trainer trained: its weights differ"
    push_weights(trainer, [rollout], doorbells=[bell], hold=True)  # awake: into a store of its own, as before
    assert differences(trainer.checksums(), rollout.checksums()) == []
    held = rollout.release_weights("trainer").released  # what the trainer's next Offload would have it close
    assert held >= 2, f"every rank's storages stayed mapped after the update: {held}"


def test_a_sharded_fp8_trainer_colocated_on_the_gpu_is_copied_as_the_replica_prepares_each_cycle(services):
    """The coordinator's colocated cycle with rlsync's trainer at --nproc 2 publishing block-FP8 to an hf
    replica on its GPU. Every offload drops the ranks' quantized stage, so each cycle's first offer describes
    FP8 boxes no refresh has filled yet: they are made empty for it, and filled before the offer leaves. The
    replica, rung at each onload, holds them and copies as it prepares (no rank sends anything: no rank bytes),
    and every sync verifies (the trainer's audit of what it quantized equals what the replica serves)."""
    model = ensure_tiny_fp8()
    co = services.start("coordinator", ["--sync-mode", "colocated"], name="co-gpu-fp8")
    on = ["--coordinator", co.address, "--model", str(model)]
    services.start("trainer", [*on, "--device", "cuda", "--nproc", "2", "--dtype", "bfloat16", "--lr", "0.01"],
                   name="gpu-trainer-fp8")
    services.start("rollout", ["--engine", "hf", "--engine-args", json.dumps({"device": "cuda", "dtype": "bfloat16"}),
                               *on], name="gpu-rollout-fp8")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    rank_bytes = []
    for step in (1, 2, 3):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified, sync
        rank_bytes.append(list(sync.trainer_rank_bytes))
    assert rank_bytes[1:] == [[], []], f"held from each onload, copied as it prepared: {rank_bytes}"
