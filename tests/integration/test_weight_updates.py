"""Versioned, atomic weight updates from a real trainer process into real rollout processes
(hf and vLLM's CPU build), over shm and gloo."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import engines, greedy_against_transformers, rollout_args
from rlsync.client import RolloutClient, RpcError, TrainerClient, push_weights, trajectory
from rlsync.common.audit import differences, trainer_dtype
from rlsync.rollout.v1 import rollout_pb2 as rpb
from rlsync.transfer.v1 import transfer_pb2 as tpb
from streams import frozen_streams

# vLLM computes in float32 here so that its audit and its greedy output compare exactly.
ENGINE_EXTRA = {"vllm": {"dtype": "float32"}, "sglang": {"dtype": "float32"}, "hf": {}}


def _trainer_args(*extra: str) -> list[str]:
    return ["--checksums", "--lr", "0.01", *extra]


def _train_once(trainer: TrainerClient, rollout: RolloutClient, seed: int = 1) -> None:
    """One real step on the rollout's own samples, so the weights differ from the checkpoint."""
    done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])


def _audit(trainer: TrainerClient, rollout: RolloutClient) -> list[str]:
    served = rollout.checksums()
    return differences(trainer.checksums(dtype=trainer_dtype(served)), served)


@pytest.fixture(scope="module", params=engines("hf", "vllm", "sglang"))
def pair(request, module_services):
    engine = request.param
    trainer = module_services.start("trainer", _trainer_args(), name=f"trainer-for-{engine}")
    rollout = module_services.start("rollout", rollout_args(engine, **ENGINE_EXTRA[engine]), name=f"rollout-{engine}")
    t, r = TrainerClient(trainer.address), RolloutClient(rollout.address)
    r.engine = engine
    yield t, r, trainer, rollout


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_update_makes_engine_weights_bit_identical_to_the_trainer(pair, backend):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout)
    assert _audit(trainer, rollout), "a step must change the weights (or this test proves nothing)"
    report = push_weights(trainer, [rollout], force_backend=backend)
    assert report.backends == {backend: 1}
    copied = "receiver_copy" if backend == "shm" else "receiver_broadcast"
    assert {"rpc", "connect", "data", copied} <= set(report.profile), report.profile
    info = rollout.info()
    assert info.weight_version == report.version == trainer.state().step and info.pending_version == -1
    assert _audit(trainer, rollout) == []
    tokens = rollout.complete("after", max_tokens=6, ignore_eos=True)[0]
    assert set(tokens.token_versions) == {report.version}


@pytest.mark.parametrize("pair", ["hf"], indirect=True)  # vLLM reloads in place: it keeps no second store
def test_an_update_lands_in_the_store_the_last_one_retired_and_a_sleep_frees_it(pair):
    trainer, rollout, _, _ = pair
    for seed in (5, 6):  # the second lands in what the first retired, whose bytes are a version older
        _train_once(trainer, rollout, seed=seed)
        push_weights(trainer, [rollout], force_backend="shm")
        memory = rollout.info().memory
        assert memory.spare_bytes == memory.weights_bytes > 0 and memory.staging_bytes == 0
        assert _audit(trainer, rollout) == []
    rollout.sleep(level=1)
    assert rollout.info().memory.spare_bytes == 0, "a sleeping engine gives the spare's memory back"
    rollout.wake_up()
    _train_once(trainer, rollout, seed=7)
    push_weights(trainer, [rollout], force_backend="shm")  # staged in a new store again
    assert _audit(trainer, rollout) == [] and rollout.info().memory.spare_bytes > 0


def test_greedy_output_equals_transformers_on_the_trainers_weights(pair, tmp_path):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout, seed=2)
    push_weights(trainer, [rollout])
    got, want = greedy_against_transformers(rollout, trainer.save_checkpoint(str(tmp_path / "ckpt")).path)
    assert got == want


def _grow_first_tensor(m: tpb.Manifest) -> None:
    """A consistent manifest (bytes match the shape) whose first tensor has one row too many."""
    t = m.tensors[0]
    row = t.nbytes // t.shape[0]
    t.shape[0] += 1
    t.nbytes += row


@pytest.mark.parametrize("corrupt, fragment", [
    (_grow_first_tensor, "has shape"),
    (lambda m: m.tensors.add(name="model.extra.weight", dtype="float32", shape=[2], nbytes=8), "unknown tensor"),
    (lambda m: m.tensors.pop(), "missing 1 tensor"),
])
def test_manifest_that_does_not_fit_is_refused_before_anything_is_written(pair, corrupt, fragment):
    trainer, rollout, _, _ = pair
    before_out = rollout.complete("stable", max_tokens=8, temperature=0, ignore_eos=True)[0].token_ids
    before_sums = rollout.checksums()
    offer = trainer.offer_weights().offer
    bad = tpb.Offer()
    bad.CopyFrom(offer)
    corrupt(bad.manifest)
    with pytest.raises(RpcError) as e:
        rollout.prepare_update(bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and fragment in e.value.message
    assert rollout.info().pending_version == -1
    assert rollout.complete("stable", max_tokens=8, temperature=0, ignore_eos=True)[0].token_ids == before_out
    assert differences(before_sums, rollout.checksums()) == []


def test_versions_regression_refused_equal_idempotent_missing_uses_step(pair):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout, seed=3)
    step = trainer.state().step
    report = push_weights(trainer, [rollout])  # no version given: the trainer's step
    assert report.version == step
    again = rollout.commit_update(step)
    assert again.version == step and not again.changed
    old = trainer.offer_weights(version=step - 1).offer
    with pytest.raises(RpcError) as e:
        rollout.prepare_update(old)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "set force to roll back" in e.value.message
    with pytest.raises(RpcError) as e:
        rollout.commit_update(step + 5)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no update is prepared" in e.value.message
    assert rollout.info().weight_version == step


def test_new_tokens_carry_the_new_version_after_commit(pair):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout, seed=4)  # a new version to commit
    (stream,) = frozen_streams(rollout, ["long"], max_tokens=700, ignore_eos=True)  # as a KEEP-mode sync does
    old = rollout.info().weight_version
    report = push_weights(trainer, [rollout])  # commits under the open stream: the switch is atomic
    rollout.resume()
    stream.thread.join(120)
    chunks, versions = stream.chunks, stream.versions()
    assert versions[0] == old and versions[-1] == report.version
    assert versions == sorted(versions), "a stream never goes back to an older version"
    spans = [(s.weight_version, s.start, s.length) for s in chunks[-1].version_spans]
    assert [v for v, _, _ in spans] == [old, report.version]
    assert sum(n for _, _, n in spans) == 700
    if rollout.engine == "vllm":  # where a gap in generation would come from, in the push's phases
        assert {"commit_pause", "commit_apply", "commit_resume"} <= set(report.phases), report.phases


def test_trainer_killed_mid_transfer_leaves_engine_on_its_version(services, small_model):
    trainer = services.start("trainer", ["--model", str(small_model), "--bucket-bytes", "4096"], name="doomed")
    rollout = services.start("rollout", ["--engine", "hf", "--model", str(small_model)], name="survivor")
    t, r = TrainerClient(trainer.address), RolloutClient(rollout.address)
    before = r.complete("steady", max_tokens=8, temperature=0, ignore_eos=True)[0].token_ids
    offer = t.offer_weights(version=1).offer
    ans = r.prepare_update(offer, force_backend="gloo").answer
    threading.Timer(0.3, trainer.kill).start()  # ~90 MB in 4 KiB buckets: well under way by then
    with pytest.raises(RpcError):
        t.publish_weights(offer.transfer_id, [ans])
    with pytest.raises(RpcError) as e:
        r.commit_update(1)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "still serving version 0" in e.value.message
    info = r.info()
    assert info.weight_version == 0 and info.pending_version == -1
    after = r.complete("steady", max_tokens=8, temperature=0, ignore_eos=True)[0]
    assert after.token_ids == before and set(after.token_versions) == {0}
    fresh = services.start("trainer", ["--model", str(small_model)], name="fresh")
    report = push_weights(TrainerClient(fresh.address), [r], version=2)
    assert r.info().weight_version == report.version == 2


def test_vllm_tensor_parallel_replica_every_worker_receives(services, tmp_path):
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    trainer = TrainerClient(services.start("trainer", _trainer_args(), name="trainer-tp").address)
    rollout = RolloutClient(services.start("rollout", rollout_args("vllm", tensor_parallel_size=2, dtype="float32"),
                                           env=env, name="rollout-tp2").address)
    assert rollout.info().tensor_parallel_size == 2
    _train_once(trainer, rollout)
    report = push_weights(trainer, [rollout])
    assert report.backends == {"shm": 2}, "each tensor-parallel worker receives the weights itself"
    assert _audit(trainer, rollout) == []
    model = AutoModelForCausalLM.from_pretrained(trainer.save_checkpoint(str(tmp_path / "c")).path).eval()
    prompt = rollout.complete("the model reads", max_tokens=1)[0].prompt_token_ids
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert rollout.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)[0].token_ids == want


def test_a_replica_rung_at_its_doorbell_prepares_without_the_callers_rpc(pair):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout, seed=5)
    bell = rollout.info().doorbell
    assert bell.address.startswith("@rlsync-doorbell-") and bell.host_id and bell.name
    report = push_weights(trainer, [rollout], doorbells=[bell])
    assert "prepare_ring" in report.profile and "prepare_rpc" not in report.profile, report.profile
    assert rollout.info().weight_version == report.version and _audit(trainer, rollout) == []
    # A refusal comes back through the trainer with the replica's status and name; nothing stays prepared.
    with pytest.raises(RpcError) as e:
        push_weights(trainer, [rollout], version=report.version - 1, doorbells=[bell])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert f"replica {bell.name}: version {report.version - 1} is older" in e.value.message
    assert rollout.info().pending_version == -1 and trainer.state().step == report.version
    # A doorbell on another host is not rung: the caller prepares that replica itself.
    elsewhere = tpb.Doorbell(host_id="another-host", address=bell.address, name=bell.name)
    again = push_weights(trainer, [rollout], doorbells=[elsewhere])
    assert "prepare_rpc" in again.profile and "prepare_ring" not in again.profile
    assert _audit(trainer, rollout) == []


@pytest.mark.parametrize("pair", ["hf"], indirect=True)  # the trainer's side: any engine
def test_a_trainer_that_rang_every_replica_sends_without_waiting_for_the_publish(pair):
    trainer, rollout, _, _ = pair
    _train_once(trainer, rollout, seed=6)
    bell = rollout.info().doorbell
    offered = trainer.offer_weights(ring=[bell], publish=True)
    assert offered.publishing and offered.rung[0].rung
    answer = offered.rung[0].answer
    stranger = tpb.Answer()
    stranger.CopyFrom(answer)
    stranger.receiver_id = "someone-else"
    with pytest.raises(RpcError) as e:  # the send under way goes to whom the trainer rang, no one else
        trainer.publish_weights(offered.offer.transfer_id, [stranger])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "already being sent to" in e.value.message
    published = trainer.publish_weights(offered.offer.transfer_id, [answer])  # collects that send
    assert published.version == offered.offer.manifest.version and published.bytes > 0
    rollout.commit_update(published.version)
    assert _audit(trainer, rollout) == []
    # A replica the trainer did not ring (its doorbell on another host): nothing starts early.
    _train_once(trainer, rollout, seed=7)
    elsewhere = tpb.Doorbell(host_id="another-host", address=bell.address, name=bell.name)
    offered = trainer.offer_weights(ring=[elsewhere], publish=True)
    assert not offered.publishing and not offered.rung[0].rung
    answer = rollout.prepare_update(offered.offer).answer
    rollout.commit_update(trainer.publish_weights(offered.offer.transfer_id, [answer]).version)
    assert _audit(trainer, rollout) == []


def test_holding_weights_mapped_is_for_a_replica_on_the_trainers_gpu(pair):
    trainer, rollout, _, _ = pair
    bell = rollout.info().doorbell
    facts = tpb.Facts(host_id=bell.host_id, device_type="cuda", gpu_uuids=["GPU-0"])
    # A CPU replica holds nothing, and says why (vLLM's: its worker, which receives the updates).
    with pytest.raises(RpcError) as e:
        rollout.hold_weights("trainer", tpb.MappedTensors(ipc=[b"handle"]), facts)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value
    assert ("maps the trainer's memory at each update" if rollout.engine == "sglang"
            else "cuda_ipc needs CUDA tensors on both sides") in e.value.message
    for holder, mapped, what in [("", [b"h"], "needs a holder"), ("trainer", [], "needs the storages")]:
        with pytest.raises(RpcError) as e:
            rollout.hold_weights(holder, tpb.MappedTensors(ipc=mapped), facts)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message
    assert rollout.release_weights("nobody").released == 0
    # A CPU trainer has nothing a replica could map: its onload rings nobody, its offload releases nothing.
    assert trainer.onload(ring=[bell]).held == 0
    assert trainer.offload().released == 0
    assert trainer.onload(ring=[bell]).state.offloaded is False
    _train_once(trainer, rollout, seed=9)
    assert rollout.info().state == rpb.SERVING_STATE_SERVING
