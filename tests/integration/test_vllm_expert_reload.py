"""vLLM's in-place reload of a mixture of experts on its CPU build (0.32), in this process: on its own it leaves
the experts as loaded where its kernel reads them prepacked, which the replica's read-back of the live experts
names; through rlsync's commit path (vllm_experts: processed as at first load) the live experts are exactly
vLLM's processing of the new weights, and it computes what transformers does on them."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlsync.models import ensure_tiny_moe
from rlsync.rollout.engines.vllm_experts import first_load_processing, live_mismatches

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


def test_vllms_own_reload_leaves_experts_its_kernel_misreads_and_the_read_back_names_them(llm):
    wrong = _reload(llm, _new_weights(1), ours=False)
    assert wrong == [f"model.layers.{i}.mlp.experts.routed_experts.{p}" for i in (0, 1)
                     for p in ("w13_weight", "w2_weight")], wrong


def test_reloads_through_rlsync_leave_the_experts_vllm_computes_with_as_it_processes_them(llm, tmp_path):
    for seed in (2, 3):  # (the second: a reload after one of ours)
        weights = _new_weights(seed)
        assert _reload(llm, weights, ours=True) == []
    reference = AutoModelForCausalLM.from_pretrained(ensure_tiny_moe(), dtype=torch.float32)
    reference.save_pretrained(tmp_path)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    from vllm import SamplingParams

    got = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == want
