"""Routed transfers on GPUs (GPU machine only): FSDP2 trainer ranks and a tensor-parallel replica's
ranks. All on one GPU, every receiver rank pulls its boxes straight from the trainer ranks' memory
(CUDA IPC), casting on the copy, and no group is formed. Over two GPUs, laid out as a colocated trainer
and engine are (trainer rank r and engine rank e on GPUs r and e), pairs on one GPU pull and the others
go over NCCL, in a group where two members share each GPU: only pairs ever form communicators."""

from __future__ import annotations

import pytest
import torch

from transfer_helpers import run_routed

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("senders,receivers", [(2, 2), (4, 2), (1, 2)])
def test_colocated_ranks_pull_exactly_their_boxes_from_every_trainer_rank(senders, receivers):
    results = run_routed(senders, receivers, 1 << 12, device="cuda")
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these boxes differ from the whole tensors: {e['wrong']}"
        assert e["received"] == e["loads"], "an engine rank receives its shard's bytes, ratio 1.00"
        assert set(e["channels"]) == {"cuda_ipc"}, f"every piece is pulled on one GPU: {e['channels']}"
    for t in trainers:
        assert t["layout_as_expected"]
        assert set(t["channels"]) <= {"cuda_ipc"}, f"nothing goes over a group on one GPU: {t['channels']}"
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)


@pytest.mark.parametrize("senders,receivers", [(2, 2), (1, 2)])
def test_colocated_ranks_holding_the_trainers_memory_pull_each_steps_values_through_a_kept_launch(senders, receivers):
    """The first transfer maps every trainer rank's storages and keeps them (hold); the second maps
    nothing and launches the table the first kept, which must copy the values of the step in between."""
    results = run_routed(senders, receivers, 1 << 12, device="cuda", HOLD="trainer", STEPS="1")
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: the step's values did not all land: {e['wrong']}"
        assert e["received"] == e["loads"]
        assert e["held"][0] > 0 and e["held"][0] == e["held"][1], \
            f"the second transfer pulls from the mappings the first kept: {e['held']}"
        assert e["held_after_release"] == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("senders,receivers", [(2, 2), (1, 2), (2, 1)])
def test_ranks_over_two_gpus_pull_on_their_gpu_and_take_the_rest_over_nccl(senders, receivers):
    results = run_routed(senders, receivers, 1 << 12, device="cuda", gpus=2)
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these boxes differ from the whole tensors: {e['wrong']}"
        assert e["received"] == e["loads"], "an engine rank receives its shard's bytes, ratio 1.00"
        assert set(e["channels"]) <= {"cuda_ipc", "nccl"}, e["channels"]
    channels = {c for e in engines for c in e["channels"]}
    assert channels == {"cuda_ipc", "nccl"}, f"pairs on one GPU pull, the others go over NCCL: {channels}"
    assert sum(t["sent"] for t in trainers) == sum(e["received"] for e in engines)


@pytest.mark.parametrize("senders,receivers", [(2, 2), (3, 2)])
def test_colocated_fp8_ranks_pull_the_quantized_boxes_and_each_steps_through_a_kept_launch(senders, receivers):
    """FP8 replica ranks on the trainer's GPU pull each trainer rank's quantized boxes and scales, made
    on the GPU into buffers that stay put (so the held second pull launches the kept table and finds the
    step's new bits), equal to the reference quantizer of the whole tensors run on the GPU."""
    results = run_routed(senders, receivers, 1 << 12, device="cuda", HOLD="trainer", STEPS="1", FP8="1")
    engines = [r for r in results if r["role"] == "engine"]
    for e in engines:
        assert e["wrong"] == [], f"engine rank {e['rank']}: these differ from the reference: {e['wrong']}"
        assert e["received"] == e["loads"] and set(e["channels"]) == {"cuda_ipc"}
