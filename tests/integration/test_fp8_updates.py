"""FP8 rollouts with real processes: a trainer that trains the tiny FP8 Qwen3 in bf16, an hf replica that
holds its linear layers in block FP8 (as the checkpoint does). The replica declares its format, the
coordinator hands it to the trainer, the trainer quantizes on the way out: half the bytes of those
weights on the wire, the FP8 values and scales bit for bit those of the reference quantizer on the
trainer's weights (vLLM's, rlsync.quant.fp8_blocks), and the engine's greedy logprobs close to the
trainer's bf16 ones (the gap is printed). A sharded trainer (a user's FSDP2 loop over 2 gloo ranks) does the
same through the routed send: every rank quantizes the rows it holds, and the replica gets the same bits."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import rl_step, rollout_args
from rlsync.client import CoordinatorClient, RolloutClient, TrainerClient
from rlsync.models import ensure_tiny_fp8
from rlsync.quant.fp8_blocks import quantize_blocks
from rlsync.quant.fp8_format import scale_name
from rlsync.transfer import audit_entry


@pytest.fixture(scope="module")
def fp8_model():
    return ensure_tiny_fp8()


def _reference_audit(checkpoint: str, weights: list[str]) -> dict[str, str]:
    """Checksums of the reference quantizer's output on the trainer's bf16 weights (its checkpoint)."""
    tensors = load_file(f"{checkpoint}/model.safetensors")
    out = {}
    for w in weights:
        q, s = quantize_blocks(tensors[w])
        out[w], out[scale_name(w)] = audit_entry(q)[2], audit_entry(s)[2]
    return out


def _logprob_gap(replica: RolloutClient, checkpoint: str) -> tuple[float, float]:
    """(mean, max) |engine logprob - trainer logprob| over the engine's greedy tokens, the trainer's model
    being its bf16 weights in transformers."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    done = replica.complete("the model reads", max_tokens=16, temperature=0, ignore_eos=True, logprobs=True)[0]
    ids = torch.tensor([done.prompt_token_ids + done.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(done.prompt_token_ids) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(done.token_ids)[:, None])[:, 0]
    gap = (torch.tensor(done.logprobs) - want).abs()
    return gap.mean().item(), gap.max().item()


def test_trainer_publishes_fp8_the_hf_replica_holds_bit_for_bit(services, fp8_model, tmp_path):
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-fp8")
    on = ["--coordinator", co.address, "--model", str(fp8_model)]
    trainer = services.start("trainer", [*on, "--dtype", "bfloat16", "--lr", "0.01"], name="trainer-fp8")
    replica = services.start("rollout", [*rollout_args("hf", dtype="bfloat16"), *on], name="rollout-fp8")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    replica, trainer = RolloutClient(replica.address), TrainerClient(trainer.address)

    fmt = replica.info().weight_format.fp8  # from the checkpoint's quantization_config, not a hand list
    assert list(fmt.block) == [128, 128] and fmt.fmt == "e4m3" and len(fmt.weights) == 14
    assert not any("embed" in w or "norm" in w or "lm_head" in w for w in fmt.weights)

    for step in (1, 2):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified  # the trainer's audit of what it sent = the replica's
    checkpoint = trainer.save_checkpoint(str(tmp_path / "ckpt")).path

    served = {t.name: t for t in replica.checksums().tensors}
    reference = _reference_audit(checkpoint, list(fmt.weights))
    assert {n: served[n].checksum for n in reference} == reference  # values and scales, bit for bit
    assert all(served[w].dtype == "float8_e4m3fn" and served[scale_name(w)].dtype == "float32" for w in fmt.weights)

    # the wire: FP8 weights are 1 byte an element where the trainer holds 2
    trained = load_file(f"{checkpoint}/model.safetensors")
    bf16_bytes = sum(t.nbytes for t in trained.values())
    fp8_bytes = sum(t.nbytes // 2 + 4 * -(-t.shape[0] // 128) * -(-t.shape[1] // 128) if n in fmt.weights
                    else t.nbytes for n, t in trained.items())
    assert sync.bytes == fp8_bytes < bf16_bytes

    mean, worst = _logprob_gap(replica, checkpoint)
    print(f"\nFP8 engine vs bf16 trainer, greedy logprobs over 16 tokens: mean gap {mean:.4f}, max {worst:.4f} nats; "
          f"bytes per sync {sync.bytes} (bf16: {bf16_bytes})")
    assert mean < 0.1


def test_the_trainer_sharded_over_two_ranks_publishes_fp8_and_every_sync_verifies(services, fp8_model):
    """`rlsync trainer --nproc 2` (FSDP2, gloo): the same FP8 bytes on the wire as one rank, every rank
    sending its rows, and the trainer's audit (every rank's share) equal to what the replica serves."""
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-fp8-nproc2")
    on = ["--coordinator", co.address, "--model", str(fp8_model)]
    services.start("trainer", [*on, "--nproc", "2", "--dtype", "bfloat16", "--lr", "0.01"], name="trainer-fp8-nproc2")
    replica = RolloutClient(services.start("rollout", [*rollout_args("hf", dtype="bfloat16"), *on],
                                           name="rollout-fp8-nproc2").address)
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    served = []
    for step in (1, 2, 3):
        sync = rl_step(client, seed=step)
        assert sync.version == step and sync.verified
        assert len(sync.trainer_rank_bytes) == 2 and min(sync.trainer_rank_bytes) > 0.3 * sync.bytes
        served.append({t.name: t.checksum for t in replica.checksums().tensors})
    fmt = replica.info().weight_format.fp8
    assert all(served[-1][scale_name(w)] for w in fmt.weights)
    assert len({tuple(sorted(s.items())) for s in served}) == 3, "every step changed what the replica serves"
    fp8_bytes = sum(math.prod(t.shape) * (1 if t.dtype == "float8_e4m3fn" else 4 if t.dtype == "float32" else 2)
                    for t in replica.checksums().tensors)
    assert sync.bytes == fp8_bytes


WORKER = Path(__file__).resolve().parents[1] / "fp8_publish_worker.py"


def test_an_fsdp2_loop_over_two_ranks_publishes_fp8_each_rank_its_rows_bit_for_bit(services, fp8_model, tmp_path):
    """Each rank quantizes the rows it holds (k_proj, v_proj, o_proj and down_proj: 128 rows, 64 a rank, so
    every scale block is cut by the shard boundary and its amax exchanged); 3 steps, each verified, and the
    replica's FP8 values and scales after each equal to the reference quantizer of the whole weights."""
    co = services.start("coordinator", ["--sync-mode", "async"], name="co-fp8-fsdp2")
    replica = services.start("rollout", [*rollout_args("hf", dtype="bfloat16"), "--coordinator", co.address,
                                         "--model", str(fp8_model)], name="rollout-fp8-fsdp2")
    with CoordinatorClient(co.address) as c:
        c.wait_ready(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        out = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "--coordinator", co.address, "--replica",
                                       replica.address, "--model", str(fp8_model), "--steps", "3"], env=env,
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait(300) for p in procs]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], "\n".join(f"rank {r}: {log[-3000:]}" for r, log in enumerate(logs))
    steps = [json.loads(line) for line in logs[0].splitlines() if line.startswith("{")]
    assert [s["version"] for s in steps] == [1, 2, 3] and all(s["verified"] for s in steps), steps
    assert [s["served_version"] for s in steps] == [1, 2, 3]
    assert all(s["weights"] == 14 and s["checked"] == 28 and s["wrong"] == [] for s in steps), steps
    assert len({tuple(s["served"]) for s in steps}) == 3, "every step changed the FP8 weights the replica serves"
    sent = steps[-1]["rank_bytes"]  # every rank sends its own rows: each about half, together every byte once
    assert len(sent) == 2 and sum(sent) == steps[-1]["bytes"] and min(sent) > 0.3 * sum(sent), steps[-1]


def test_delta_updates_send_only_the_fp8_bytes_that_changed_and_end_bit_for_bit(services, fp8_model):
    """--delta with an FP8 replica: the trainer keeps what it quantized (a buffer of its own, filled at
    every offer), so each update after the first sends only the words of FP8 values and scales that
    changed since the replicas' base; every sync verified, the replica's tensors the trainer's."""
    co = services.start("coordinator", ["--sync-mode", "async", "--force-backend", "gloo"], name="co-fp8-delta")
    on = ["--coordinator", co.address, "--model", str(fp8_model)]
    tr = services.start("trainer", [*on, "--delta", "--dtype", "bfloat16", "--lr", "1e-4", "--bucket-bytes", "65536"],
                        name="trainer-fp8-delta")
    replica = services.start("rollout", [*rollout_args("hf", dtype="bfloat16"), *on], name="rollout-fp8-delta")
    client = CoordinatorClient(co.address)
    client.wait_ready(2)
    syncs = [rl_step(client, seed) for seed in range(4)]
    assert all(s.verified for s in syncs), syncs
    assert syncs[0].wire_bytes == syncs[0].bytes, "the first update has no base: it goes whole"
    assert all(s.wire_bytes < s.bytes for s in syncs[1:]), [(s.wire_bytes, s.bytes) for s in syncs]
    served = {t.name: t.checksum for t in RolloutClient(replica.address).checksums().tensors}
    sent = {t.name: t.checksum for t in TrainerClient(tr.address).checksums().tensors}
    assert served == sent
    print(f"\nFP8 delta updates, wire bytes over bytes: {[round(s.wire_bytes / s.bytes, 3) for s in syncs]}")
