"""vLLM's in-place reload of a mixture of experts on its CPU build (0.32), in this process: on its own it leaves
the experts as loaded where its kernel reads them prepacked, which the replica's read-back of the live experts
names; through rlsync's commit path (vllm_experts.reload: the experts loaded apart, processed by vLLM's experts and
handed over in kernel format; or everything through vLLM's reload, processed as at first load) the live experts
are exactly vLLM's processing of the new weights, and it computes what transformers does on them."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlsync.models import ensure_tiny_moe
from rlsync.rollout.engines.vllm_experts import (apart_copies, expert_layers, first_load_processing, live_mismatches,
                                                  placement, reload)
from rlsync.rollout.engines.vllm_layout import BoxStaging, probe_loads
from rlsync.transfer.manifest import Spec

pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def llm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process (conftest sets it too)
    from vllm import LLM

    engine = LLM(model=str(ensure_tiny_moe()), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                 max_num_seqs=4)
    yield engine
    del engine


def _new_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in
            load_file(str(ensure_tiny_moe() / "model.safetensors")).items()}


def _reload(llm, weights: dict[str, torch.Tensor], ours: bool) -> list[str]:
    """Reloads `weights` in place (through rlsync's first-load processing when `ours`), then reads back which
    live expert parameters differ from vLLM's processing of them."""
    def run(worker):
        model = worker.model_runner.get_model()
        with first_load_processing(model) if ours else contextlib.nullcontext():
            worker.reload_weights(weights_iterator=iter(weights.items()))
        return live_mismatches(model, iter(weights.items()))

    return llm.llm_engine.collective_rpc(run)[0]


def _reload_apart(llm, weights: dict[str, torch.Tensor], apart: bool, copies, placed: bool = False
                  ) -> tuple[list[str], list[str], object]:
    """Reloads `weights` through vllm_experts.reload with the expert tensors the probe finds (`apart`: loaded apart,
    by `copies` where given, else read back; `placed`: the experts staged in the blocks the copies place them in, as
    a transfer loads them, the rest handed from the same staging) -> (those tensors, the live expert parameters that
    then differ from vLLM's processing of them, and after a read back the copies vLLM's loaders amount to:
    apart_copies)."""
    def run(worker):
        model = worker.model_runner.get_model()
        specs = [Spec.of(n, t) for n, t in weights.items()]
        loads = probe_loads(model, specs, expert_layers(model))
        experts, handed, blocks = loads.into_layers, lambda: iter(weights.items()), None
        if placed:
            where = placement(copies, specs, loads.boxes)
            assert where is not None and {name for name, _, _ in where.at} == experts
            staging = BoxStaging(specs, loads.boxes, torch.device("cpu"), where)
            for name, view in staging.views.items():  # (what the transfer writes: each staged box)
                view.copy_(weights[name][tuple(slice(a, b) for a, b in staging.boxes[name])])
            handed, blocks = staging.full, staging.blocks()
            assert experts.isdisjoint(dict(staging.full())) and len(blocks) == 4
        wrong = reload(worker.reload_weights, model, handed, experts, apart, copies, blocks)
        learnt = None if apart else apart_copies(model, [(n, t) for n, t in weights.items() if n in experts])
        return sorted(experts or ()), wrong + live_mismatches(model, iter(weights.items())), learnt

    return llm.llm_engine.collective_rpc(run)[0]


def _greedy_against_transformers(llm, weights: dict[str, torch.Tensor], folder) -> tuple[list[int], list[int]]:
    reference = AutoModelForCausalLM.from_pretrained(ensure_tiny_moe(), dtype=torch.float32)
    reference.save_pretrained(folder)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    from vllm import SamplingParams

    got = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    return list(got), want


def test_vllms_own_reload_leaves_experts_its_kernel_misreads_and_the_read_back_names_them(llm):
    wrong = _reload(llm, _new_weights(1), ours=False)
    assert wrong == [f"model.layers.{i}.mlp.experts.routed_experts.{p}" for i in (0, 1)
                     for p in ("w13_weight", "w2_weight")], wrong


def test_reloads_through_rlsync_leave_the_experts_vllm_computes_with_as_it_processes_them(llm, tmp_path):
    for seed in (2, 3):  # (the second: a reload after one of ours)
        weights = _new_weights(seed)
        assert _reload(llm, weights, ours=True) == []
    got, want = _greedy_against_transformers(llm, weights, tmp_path)
    assert got == want


def test_experts_loaded_apart_and_handed_in_kernel_format_are_vllms_processing_and_compute_as_transformers(
        llm, tmp_path):
    """The commit's path: the probe finds every expert tensor (and only those) filling the expert layers; a first
    reload through vLLM's reload path reads them back equal to their processing apart, and the copies vLLM's loaders
    amount to (learnt then) make the same live experts; the next are loaded (by vLLM's loaders, then by those
    copies) and processed apart and handed to vLLM's reload in kernel format, the rest through its reload path;
    then greedy tokens equal transformers' on the weights."""
    names = sorted(n for n in _new_weights(0) if ".mlp.experts." in n)
    experts, wrong, copies = _reload_apart(llm, _new_weights(4), apart=False, copies=None)
    assert (experts, wrong) == (names, []) and copies, "the expert tensors fill the layers by plain copies of boxes"
    for seed, by in ((5, None), (6, copies), (7, copies)):
        weights = _new_weights(seed)
        assert _reload_apart(llm, weights, apart=True, copies=by) == (names, [], None)
    got, want = _greedy_against_transformers(llm, weights, tmp_path)
    assert got == want


def test_experts_the_transfer_loads_into_their_place_are_vllms_processing_and_compute_as_transformers(llm, tmp_path):
    """Once the copies are learnt, a staging lays each expert tensor's box out where vLLM's loaders copy it, in blocks
    shaped as the expert parameters as first loaded (placement): what the transfer writes there is processed as it
    lies, with no loader call and no copy, and the live experts are vLLM's processing of the weights; the rest are
    handed from the same staging; greedy tokens equal transformers' on them."""
    names = sorted(n for n in _new_weights(0) if ".mlp.experts." in n)
    experts, wrong, copies = _reload_apart(llm, _new_weights(8), apart=False, copies=None)
    assert (experts, wrong) == (names, []) and copies
    for seed in (9, 10):
        weights = _new_weights(seed)
        assert _reload_apart(llm, weights, apart=True, copies=copies, placed=True) == (names, [], None)
    got, want = _greedy_against_transformers(llm, weights, tmp_path)
    assert got == want
