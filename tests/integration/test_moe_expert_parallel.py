"""The routing plan of a mixture of experts under expert parallelism, derived by vLLM's own loaders: a real
vLLM (CPU build) of TP = 2 with `enable_expert_parallel` loads the tiny MoE, and each worker's layout (what
rlsync_layout answers a routed offer with) holds only its own experts, whole. vLLM's CPU path cannot serve
under EP (its fused-MoE kernel is not given the expert map: a forward crashes), so nothing generates here:
the plan is what the CPU can check; serving EP runs on GPUs."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rlsync.models import ensure_tiny_moe
from rlsync.rollout.engines.checkpoint import checkpoint_tensors
from rlsync.transfer.manifest import Spec, to_proto
from rlsync.transfer.sharded import layout_of
from rlsync.transfer.v1 import transfer_pb2 as pb

pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)


def _stacked_specs(model) -> list[Spec]:
    """The tiny MoE's tensors as a trainer sends them to replicas that take its experts stacked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlsync.checkpoint_names import expert_rules
    from rlsync.publish.mapping import WeightMap

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    params = [(n, tuple(p.shape), torch.float32) for n, p in meta.named_parameters()]
    entries = WeightMap().plan(params, expert_rules(meta), stacked={n for n, _, _ in params})
    return [Spec(e.name, e.dtype, e.shape, 4 * math.prod(e.shape)) for e in entries]


@pytest.fixture(scope="module")
def ep_layouts():
    """(checkpoint specs, the routing Layout of a TP = 2, EP vLLM engine's two workers for them; the same of the
    experts stacked)."""
    # (two workers: vLLM's multiprocess executor; the environment is put back for the tests after these)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM  # (imported here, not at collection: it changes the environment)

    from rlsync.rollout.engines.vllm import WORKER_EXTENSION

    model = ensure_tiny_moe()
    specs = [Spec(n, torch.float32, tuple(shape), 4 * math.prod(shape))
             for n, (shape, _) in checkpoint_tensors(str(model)).items()]
    offer = pb.Offer(manifest=to_proto(specs, 1)).SerializeToString()
    stacked = _stacked_specs(model)
    stacked_offer = pb.Offer(manifest=to_proto(stacked, 1)).SerializeToString()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
              tensor_parallel_size=2, enable_expert_parallel=True, worker_extension_cls=WORKER_EXTENSION)
    try:
        layouts = [pb.RankLayout.FromString(raw) for raw in llm.collective_rpc("rlsync_layout", args=(offer,))]
        stacked_layouts = [pb.RankLayout.FromString(raw)
                           for raw in llm.collective_rpc("rlsync_layout", args=(stacked_offer,))]
    finally:
        llm.llm_engine.engine_core.shutdown()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return specs, layout_of(specs, layouts), stacked, layout_of(stacked, stacked_layouts)


def _bytes(specs, held, which) -> int:
    return sum(4 * math.prod(b - a for a, b in box) for s, boxes in zip(specs, held) if which(s.name)
               for box in boxes)


def test_each_expert_parallel_worker_loads_only_its_own_experts_whole(ep_layouts):
    specs, layout, _, _ = ep_layouts
    index = {s.name: i for i, s in enumerate(specs)}
    for rank, mine in ((0, range(4)), (1, range(4, 8))):
        held = layout.held[rank]
        for e in range(8):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
                boxes = held[index[name]]
                whole = [tuple((0, d) for d in specs[index[name]].shape)]
                assert list(boxes) == (whole if e in mine else []), (rank, name, boxes)
    experts = _bytes(specs, [[tuple((0, d) for d in s.shape)] for s in specs], lambda n: ".mlp.experts." in n)
    per_rank = [_bytes(specs, layout.held[r], lambda n: ".mlp.experts." in n) for r in (0, 1)]
    assert per_rank == [experts // 2] * 2, f"each rank's expert bytes are half the experts': {per_rank} of {experts}"


def test_stacked_each_expert_parallel_worker_loads_one_box_its_run_of_experts(ep_layouts):
    """The experts stacked ([E, n, R, H], one tensor per layer and projection): a worker's box of each is its
    4 experts whole, one box, and its expert bytes are half the experts' as per expert."""
    specs, layout, stacked, stacked_layout = ep_layouts
    index = {s.name: i for i, s in enumerate(stacked)}
    for rank in (0, 1):
        for proj in ("gate_up_proj", "down_proj"):
            i = index[f"model.layers.1.mlp.experts.{proj}"]
            shape = stacked[i].shape
            assert list(stacked_layout.held[rank][i]) == [((4 * rank, 4 * rank + 4), *((0, d) for d in shape[1:]))]
    experts = _bytes(specs, [[tuple((0, d) for d in s.shape)] for s in specs], lambda n: ".mlp.experts." in n)
    per_rank = [_bytes(stacked, stacked_layout.held[r], lambda n: ".mlp.experts." in n) for r in (0, 1)]
    assert per_rank == [experts // 2] * 2 and len(stacked) == len(specs) - 2 * (3 * 8 - 2)
    rest = [i for i, s in enumerate(specs) if ".mlp.experts." not in s.name]
    assert [stacked_layout.held[r][index[specs[i].name]] for r in (0, 1) for i in rest] == \
        [layout.held[r][i] for r in (0, 1) for i in rest], "the rest as without stacking"


def test_under_expert_parallelism_the_rest_is_still_tensor_parallel(ep_layouts):
    """Attention and the vocabulary split by TP as without EP; the router and norms held whole by both."""
    specs, layout, _, _ = ep_layouts
    index = {s.name: i for i, s in enumerate(specs)}
    q = index["model.layers.0.self_attn.q_proj.weight"]
    rows = specs[q].shape[0]
    assert [list(layout.held[r][q]) for r in (0, 1)] == [[((0, rows // 2), (0, 64))], [((rows // 2, rows), (0, 64))]]
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        whole = [tuple((0, d) for d in specs[index[name]].shape)]
        assert [list(layout.held[r][index[name]]) for r in (0, 1)] == [whole, whole], name
