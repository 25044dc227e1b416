"""Bring your own trainer: a user's loop publishes through rlsync.publish to real replicas behind a real
coordinator; sharded (FSDP2 over 2 gloo ranks, separate processes), renamed, cast, and a rank that dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import as_left, engines, rollout_args, two_gloo_ranks
from hangs import FAST, report
from rlsync.client import CoordinatorClient, RolloutClient, RpcError
from rlsync.coordinator.v1.coordinator_pb2 import ROLE_TRAINER
from rlsync.common.audit import LIVE, differences, to_proto, trainer_dtype
from rlsync.publish import WeightMap, WeightPublisher
from rlsync.transfer import audit_entry
from rlsync.transfer.dtypes import dtype_of

WORKER = Path(__file__).resolve().parents[1] / "publish_worker.py"


@pytest.fixture
def fleet(services, tiny_model):
    """A coordinator (async sync) and one replica of the engine asked for; no rlsync trainer."""
    def start(engine: str):
        co = services.start("coordinator", ["--sync-mode", "async"], name=f"co-{engine}")
        replica = services.start("rollout", rollout_args(engine, "--coordinator", co.address), name=f"pub-{engine}")
        with CoordinatorClient(co.address) as c:
            c.wait_ready(1)
        return co.address, RolloutClient(replica.address)
    return start


def serves_exactly(replica: RolloutClient, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Differences between what the replica serves and `tensors` (cast as the replica computes)."""
    served = replica.checksums()
    dtype = dtype_of(trainer_dtype(served)) if trainer_dtype(served) else None
    names = {t.name for t in served.tensors}
    expected = {n: audit_entry(t.to(dtype) if dtype and t.is_floating_point() else t)
                for n, t in tensors.items() if n in names}
    return differences(to_proto(served.version, expected, LIVE), served)


def start_ranks(tmp_path: Path, args: list[str], world: int = 2, fault: dict[int, str] | None = None):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               "RLSYNC_FAULT": (fault or {}).get(rank, "")}
        out = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdin=subprocess.DEVNULL,
                                      stdout=out, stderr=subprocess.STDOUT))
    return procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("engine", engines("hf", "vllm", "sglang"))
def test_fsdp2_over_two_ranks_publishes_bit_exact(fleet, tmp_path, engine):
    coordinator, replica = fleet(engine)
    saved = tmp_path / "full.safetensors"
    procs = start_ranks(tmp_path, ["--coordinator", coordinator, "--steps", "2", "--verify", "--save", str(saved),
                                   "--bucket-bytes", "65536"])
    codes = [p.wait(240) for p in procs]
    assert codes == [0, 0], "\n".join(f"rank {r}: {(tmp_path / f'rank{r}.log').read_text()[-2000:]}" for r in (0, 1))
    steps = _lines(tmp_path / "rank0.log")
    assert [s["version"] for s in steps] == [1, 2] and all(s["verified"] for s in steps), steps
    assert replica.info().weight_version == 2
    assert serves_exactly(replica, load_file(saved)) == [], "the replica serves the unsharded state dict, bit for bit"


@pytest.fixture(scope="module")
def tp2_fleet(module_services):
    """A coordinator (async sync) and a tensor-parallel vLLM replica (TP = 2) that the world sizes below take
    turns on, and the version the last of them left it on (a start costs more than all their steps)."""
    co = module_services.start("coordinator", ["--sync-mode", "async"], name="co-tp2")
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    replica = RolloutClient(module_services.start("rollout", rollout_args("vllm", "--coordinator", co.address,
                                                                          tensor_parallel_size=2, dtype="float32"),
                                                  env=env, name="pub-tp2").address)
    with CoordinatorClient(co.address) as c:
        c.wait_ready(1)
    yield co.address, replica, {"version": 0}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_into_a_tensor_parallel_vllm_replica_routes_each_worker_its_boxes(tp2_fleet, tmp_path, world):
    """Every trainer rank sends its own rows; each of the replica's two workers receives only the boxes
    its loaders keep (found by vLLM's own loaders), and serves exactly the unsharded state dict."""
    coordinator, replica, left = tp2_fleet
    as_left(replica, left["version"])  # each world's loop goes on from the version the one before left
    with CoordinatorClient(coordinator) as c:
        assert [m.name for m in c.status().members if m.role == ROLE_TRAINER] == [], "the last loop left the fleet"
    base = left["version"]
    saved = tmp_path / "full.safetensors"
    procs = start_ranks(tmp_path, ["--coordinator", coordinator, "--steps", "3", "--after-step", str(base), "--verify",
                                   "--save", str(saved), "--bucket-bytes", "65536"], world=world)
    codes = [p.wait(300) for p in procs]
    assert codes == [0] * world, "\n".join(f"rank {r}: {(tmp_path / f'rank{r}.log').read_text()[-2000:]}"
                                          for r in range(world))
    steps = _lines(tmp_path / "rank0.log")
    assert [s["version"] for s in steps] == [base + 1, base + 2, base + 3] and all(s["verified"] for s in steps), steps
    info = replica.info()
    assert info.weight_version == base + 3
    left["version"] = base + 3
    assert serves_exactly(replica, load_file(saved)) == [], "the workers' boxes add up to the unsharded state dict"
    served = {t.name for t in replica.checksums().tensors}  # the checkpoint's (a tied lm_head is not one)
    split, held_whole = _tp_split({n: t for n, t in load_file(saved).items() if n in served})
    assert list(info.received_bytes) == [split // 2 + held_whole] * 2, "each worker received exactly its boxes"
    sent = steps[-1]["rank_bytes"]  # what each trainer rank sent: together every received byte, each its share
    assert len(sent) == world and sum(sent) == sum(info.received_bytes), sent
    assert max(sent) <= 1.25 * sum(sent) / world, f"rank 0 sends no more than its share: {sent}"


def _tp_split(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """fp32 bytes two tensor-parallel ranks of the tiny Qwen2 split between them (weights by rows or
    columns, the vocabulary by rows, the q/k/v biases with their heads: 2 key/value heads over 2
    ranks), and bytes each holds whole (the norms)."""
    split = sum(t.numel() * 4 for n, t in tensors.items() if t.dim() == 2 or n.endswith(".bias"))
    return split, sum(t.numel() * 4 for n, t in tensors.items() if t.dim() == 1 and not n.endswith(".bias"))


def test_a_replica_killed_mid_routed_transfer_fails_that_sync_fast_and_the_survivor_gets_it(services, tmp_path):
    """FSDP2 over 2 ranks into two hf replicas; one dies in the middle of receiving step 2's boxes.
    The trainer's ranks fail at once (not at the transfer deadline), the coordinator takes the update
    to the survivor in the same sync, and every step is verified there."""
    co = services.start("coordinator", ["--sync-mode", "async", "--lease", "1.5", "--heartbeat-interval", "0.3"],
                        name="co-routed-dies")
    dying = Path(__file__).resolve().parents[1] / "rollout_worker.py"
    replicas = [services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--replica-id", f"r{i}"],
                               name=f"routed-r{i}", env={"RLSYNC_FAULT": "die_after_receives:40"} if i == 0 else None,
                               script=dying if i == 0 else None) for i in range(2)]
    with CoordinatorClient(co.address) as c:
        c.wait_ready(2)
    # The tiny model in 64 KiB buckets: each rank sends a replica about 26 buckets a step, so r0
    # dies in the middle of step 2.
    procs = start_ranks(tmp_path, ["--coordinator", co.address, "--steps", "3", "--verify", "--bucket-bytes", "65536"])
    codes = [p.wait(240) for p in procs]
    assert codes == [0, 0], "\n".join(f"rank {r}: {(tmp_path / f'rank{r}.log').read_text()[-2000:]}" for r in (0, 1))
    assert replicas[0].proc.wait(30) == 9
    steps = _lines(tmp_path / "rank0.log")
    assert [s["version"] for s in steps] == [1, 2, 3] and all(s["verified"] for s in steps), steps
    assert steps[1]["sync_seconds"] < 30, "the dead replica's group failed at once, not at the 300 s deadline"
    survivor = RolloutClient(replicas[1].address)
    assert survivor.info().weight_version == 3


def test_renamed_and_cast_model_publishes_and_a_mismatch_is_refused_by_name(fleet, tiny_model):
    coordinator, replica = fleet("hf")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    wrapped = torch.nn.ModuleDict({"policy": model})  # names gain a "policy." prefix the engine does not know
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    to_engine = WeightMap(rename=lambda n: n.removeprefix("policy."), dtype=torch.bfloat16)
    with WeightPublisher(wrapped, coordinator, weights=to_engine) as pub:
        sync = pub.publish(1, verify=True)
        assert sync.version == 1 and sync.verified
    sent = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    assert serves_exactly(replica, sent) == [], "bf16 on the wire, as the engine computes"

    with WeightPublisher(wrapped, coordinator) as pub:  # no rename: every name is unknown to the engine
        with pytest.raises(RpcError) as e:
            pub.publish(2)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown tensor 'policy.model.embed_tokens.weight'" in e.value.message
    assert replica.info().weight_version == 1, "nothing moved: the replica keeps the version it had"


def test_a_rank_killed_mid_publish_fails_cleanly_and_the_old_version_stays(fleet, tmp_path):
    coordinator, replica = fleet("hf")
    # Tiny model: 26 tensors, each sharded by rows: rank 1 sends a piece of each, 15 buckets of 64 kB a step.
    # It dies half way through sending step 2's.
    procs = start_ranks(tmp_path, ["--coordinator", coordinator, "--steps", "2", "--bucket-bytes", "65536"],
                        fault={1: "die_after_buckets:22"})
    codes = [p.wait(240) for p in procs]
    log = (tmp_path / "rank0.log").read_text()
    assert codes[1] == 9 and codes[0] != 0, (codes, log[-3000:])
    assert [s["version"] for s in _lines(tmp_path / "rank0.log")] == [1]
    assert "publishing step 2 failed" in log, log[-3000:]
    assert replica.info().weight_version == 1
    assert replica.complete("still serving", max_tokens=4, ignore_eos=True)[0].token_ids, "the replica serves on"
    with CoordinatorClient(coordinator) as c:
        assert c.status().members, "the coordinator is up and still has the replica"


def test_a_rank_hung_mid_publish_takes_the_trainer_out_within_the_lease_and_a_later_step_publishes(services,
                                                                                                    tmp_path):
    """FSDP2 over 2 ranks; rank 1 stops (SIGSTOP) half way through sending step 2's buckets (15 a step).
    Rank 0 still answers the coordinator, but once rank 1 is
    silent for the lease it takes the trainer out of the fleet: the sync under way is abandoned and the
    replica serves step 1 with nothing staged. After SIGCONT the trainer registers again, step 2 fails
    on both ranks (the loop goes on: --keep-going) and step 3 is published and verified."""
    co = services.start("coordinator", ["--sync-mode", "async", *FAST], name="co-rank-hangs")
    replica = RolloutClient(services.start("rollout", rollout_args("hf", "--coordinator", co.address),
                                           name="rank-hangs-r0").address)
    client = CoordinatorClient(co.address)
    client.wait_ready(1)
    procs = start_ranks(tmp_path, ["--coordinator", co.address, "--steps", "3", "--verify", "--keep-going",
                                   "--bucket-bytes", "65536"], fault={1: "hang_after_buckets:22"})
    deadline = time.monotonic() + 120
    while _state(procs[1].pid) != "T":
        assert time.monotonic() < deadline and procs[1].poll() is None, (tmp_path / "rank1.log").read_text()[-2000:]
        time.sleep(0.01)
    stopped = time.monotonic()
    try:
        while any(m.role == ROLE_TRAINER for m in client.status().members) or replica.info().pending_version != -1:
            assert time.monotonic() < stopped + 60, "the trainer stayed in the fleet 60 s after a rank hung"
            time.sleep(0.05)
        report("a rank of a sharded loop hung mid-publish", time.monotonic() - stopped)
        info = replica.info()
        assert info.state == 1 and info.weight_version == 1 and info.memory.staging_bytes == 0, info
        assert replica.complete("still serving", max_tokens=4, ignore_eos=True)[0].max_weight_version == 1
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    codes = [p.wait(240) for p in procs]
    assert codes == [0, 0], "\n".join(f"rank {r}: {(tmp_path / f'rank{r}.log').read_text()[-2000:]}" for r in (0, 1))
    steps = _lines(tmp_path / "rank0.log")
    assert [s.get("version") for s in steps] == [1, None, 3], steps
    assert "rank 1 of its 2 ranks has not been heard from" in steps[1]["failed"], steps[1]
    assert steps[2]["verified"] and replica.info().weight_version == 3


def _state(pid: int) -> str:
    """A process's state letter (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_every_dtensor_placement_is_cut_into_boxes_and_audited_without_a_gather(tmp_path):
    """Dim-0 shards (uneven, empty, fewer rows than ranks), dim-1 shards (tensor parallel),
    replicated and plain tensors, over 2 gloo ranks: each rank's boxes are the whole tensors' cast to
    bf16, and the checksum shares of the ranks add up to the whole tensors' checksums. (Ranks.gather, what a
    sharded trainer's onload gathers the ranks' storages with, and Ranks.broadcast, what rank 0 tells the others
    each request with, are checked there too.)"""
    two_gloo_ranks(WORKER.parent / "dtensor_worker.py", results=8)


def test_the_trainer_killed_mid_transfer_leaves_the_old_version_and_a_new_trainer_syncs(fleet, tmp_path):
    coordinator, replica = fleet("hf")
    # One rank, so the process that dies is the one serving the transfer: half way through sending
    # step 2's 26 tensors (29 buckets of 64 kB a step), with buckets already on the replica.
    dead = tmp_path / "dead"
    dead.mkdir()
    (proc,) = start_ranks(dead, ["--coordinator", coordinator, "--steps", "2", "--bucket-bytes", "65536"], world=1,
                          fault={0: "die_after_buckets:43"})
    assert proc.wait(240) == 9
    assert [s["version"] for s in _lines(dead / "rank0.log")] == [1]
    deadline = time.monotonic() + 30  # the replica hears of it from the broken channel, then the coordinator
    while (info := replica.info()).pending_version != -1 or info.memory.staging_bytes:
        assert time.monotonic() < deadline, f"staging still held 30 s after the trainer died: {info}"
        time.sleep(0.2)
    assert info.weight_version == 1 and info.state == 1, "serving the old version, never a half-updated one"
    assert replica.complete("still serving", max_tokens=4, ignore_eos=True)[0].max_weight_version == 1
    # A new trainer registers in its place and syncs, verified.
    (proc,) = start_ranks(tmp_path, ["--coordinator", coordinator, "--steps", "2", "--verify", "--bucket-bytes",
                                     "65536"], world=1)
    assert proc.wait(240) == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    steps = _lines(tmp_path / "rank0.log")
    assert [s["version"] for s in steps] == [1, 2] and all(s["verified"] for s in steps), steps
    assert replica.info().weight_version == 2
