"""The trainer service in its own process: GRPO steps, validation, staleness, offload/onload that
really frees memory and resumes exactly, and checkpoints that resume bit-exactly."""

from __future__ import annotations

import random
import time

import grpc
import psutil
import pytest

from rlsync.client import RolloutClient, RpcError, TrainerClient
from rlsync.common.audit import differences
from rlsync.trainer.v1 import trainer_pb2 as pb


def batch(seed: int, n: int = 8, versions: list[int] | None = None) -> list[pb.Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, 500) for _ in range(5)]
        completion = [rng.randrange(1, 500) for _ in range(7)]
        out.append(pb.Trajectory(prompt_ids=prompt, completion_ids=completion, reward=rng.random(),
                                 group_id=f"g{i // 4}", token_versions=versions or []))
    return out


def test_train_steps_and_refuses_bad_input(services):
    t = TrainerClient(services.start("trainer", [], name="trainer-basic").address)
    r = t.train(batch(0))
    assert r.step == 1 and r.trajectories_used == 8 and r.metrics["tokens"] == 56
    assert abs(r.metrics["ratio_mean"] - 1.0) < 1e-6, "no behaviour logprobs: on-policy ratio"
    for trajectories, code, fragment in [
        ([], grpc.StatusCode.INVALID_ARGUMENT, "at least one trajectory"),
        ([pb.Trajectory(prompt_ids=[1], completion_ids=[], reward=1)], grpc.StatusCode.INVALID_ARGUMENT,
         "must both be non-empty"),
        ([pb.Trajectory(prompt_ids=[1], completion_ids=[99999], reward=1)], grpc.StatusCode.INVALID_ARGUMENT,
         "outside the vocabulary"),
        ([pb.Trajectory(prompt_ids=[1], completion_ids=[2, 3], reward=1, behavior_logprobs=[-1.0])],
         grpc.StatusCode.INVALID_ARGUMENT, "1 behavior_logprobs for 2 completion tokens"),
        ([pb.Trajectory(prompt_ids=[1], completion_ids=[2], reward=1, token_versions=[7])],
         grpc.StatusCode.INVALID_ARGUMENT, "newer than the trainer's step"),
    ]:
        with pytest.raises(RpcError) as e:
            t.train(trajectories)
        assert e.value.code == code and fragment in e.value.message
    assert t.state().step == 1, "refused requests do not step"


def test_staleness_bound_drops_or_downweights(services):
    t = TrainerClient(services.start("trainer", [], name="trainer-stale").address)
    for s in range(3):
        t.train(batch(s))
    fresh, stale = batch(10, 4, versions=[3] * 7), batch(11, 4, versions=[0] * 7)
    r = t.train(fresh + stale, max_staleness=1, stale_policy="drop")
    assert (r.stale, r.dropped, r.trajectories_used) == (4, 4, 4)
    r = t.train(fresh + stale, max_staleness=1, stale_policy="downweight", stale_weight=0.5)
    assert (r.stale, r.dropped, r.trajectories_used) == (4, 0, 8)
    r = t.train(stale, max_staleness=100)
    assert r.stale == 0 and r.trajectories_used == 4


def test_offload_frees_memory_and_training_resumes_exactly(services, small_model):
    a = services.start("trainer", ["--model", str(small_model)], name="offloader")
    b = services.start("trainer", ["--model", str(small_model)], name="reference")
    ta, tb = TrainerClient(a.address), TrainerClient(b.address)
    for t in (ta, tb):
        t.train(batch(1))
    before = ta.state()
    rss_before = psutil.Process(a.proc.pid).memory_info().rss
    off = ta.offload().state
    rss_after = psutil.Process(a.proc.pid).memory_info().rss
    assert off.offloaded and off.device_bytes == 0
    assert before.device_bytes == 3 * 4 * before.parameters  # float32 weights + two Adam moments
    assert rss_before - rss_after > 0.6 * before.device_bytes, (rss_before, rss_after)
    with pytest.raises(RpcError) as e:
        ta.train(batch(2))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "Onload" in e.value.message
    with pytest.raises(RpcError) as e:
        ta.offer_weights()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    on = ta.onload().state
    assert not on.offloaded and on.device_bytes == before.device_bytes
    for t in (ta, tb):
        t.train(batch(2))
    assert differences(tb.checksums(), ta.checksums()) == []


def test_checkpoint_resumes_bit_exactly(services, tmp_path):
    a = TrainerClient(services.start("trainer", [], name="ckpt-a").address)
    a.train(batch(1))
    saved = a.save_checkpoint(str(tmp_path / "step1"))
    assert saved.step == 1
    a.train(batch(2))
    b = TrainerClient(services.start("trainer", [], name="ckpt-b").address)
    assert b.load_checkpoint(saved.path).step == 1
    b.train(batch(2))
    assert b.state().step == a.state().step == 2
    assert differences(a.checksums(), b.checksums()) == []
    with pytest.raises(RpcError) as e:
        b.load_checkpoint(str(tmp_path / "nothing-here"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not an rlsync checkpoint" in e.value.message


def test_two_rank_trainer_trains_like_one_and_its_syncs_verify(services):
    """--nproc 2: the policy sharded with FSDP2 over two processes (gloo). The same steps give the
    same weights, bit for bit, as one rank (without gradient clipping, whose norm sums in another
    order); the shards are gathered on the way to the replica."""
    from conftest import rollout_args
    from rlsync.client import CoordinatorClient

    co = services.start("coordinator", ["--sync-mode", "async"], name="co-nproc")
    two = services.start("trainer", ["--nproc", "2", "--max-grad-norm", "0", "--coordinator", co.address],
                         name="trainer-nproc2")
    replica = services.start("rollout", rollout_args("hf", "--coordinator", co.address), name="rollout-nproc")
    one = TrainerClient(services.start("trainer", ["--max-grad-norm", "0"], name="trainer-nproc1").address)
    with CoordinatorClient(co.address) as fleet:
        fleet.wait_ready(2)
        for step in (1, 2):
            assert fleet.train(batch(step)).step == step
            assert one.train(batch(step)).step == step
            sync = fleet.sync_weights(verify=True)
            assert sync.version == step and sync.verified, "the replica serves the gathered shards"
    sharded = TrainerClient(two.address)
    assert differences(one.checksums(), sharded.checksums()) == []
    assert sharded.state().parameters == one.state().parameters
    assert sharded.offload().state.offloaded
    with RolloutClient(replica.address) as rollout:
        bell = rollout.info().doorbell
        with pytest.raises(RpcError) as e:  # every rank refuses alike as the offer describes their memory
            sharded.offer_weights(ring=[bell], hold=True)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "Onload" in e.value.message, e.value
        # rung: every rank exports its shards, rank 0 gathers what a replica could map (on CPU: nothing)
        onloaded = sharded.onload(ring=[bell])
    assert not onloaded.state.offloaded and onloaded.held == 0
    with CoordinatorClient(co.address) as fleet:  # every rank let go of its sender at the offload, and sends again
        assert fleet.train(batch(3)).step == 3 and fleet.sync_weights(verify=True).verified
    with pytest.raises(RpcError) as e:
        sharded.save_checkpoint("/tmp/nope")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--nproc" in e.value.message
    (rank1,) = [p for p in psutil.Process(two.proc.pid).children() if "rlsync.rpc.beacon" not in p.cmdline()]
    rank1.kill()
    deadline = time.monotonic() + 10
    while "NOT_SERVING" not in (two.why_down() or ""):
        assert time.monotonic() < deadline, "a trainer that lost a rank should say NOT_SERVING"
        time.sleep(0.1)
    assert "trainer rank 1 was killed by SIGKILL" in two.log_path.read_text()
