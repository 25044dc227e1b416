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


@pytest.fixture(scope="module")
def ep_layouts():
    """(checkpoint specs, the routing Layout of a TP = 2, EP vLLM engine's two workers for them)."""
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
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_num_seqs=4,
              tensor_parallel_size=2, enable_expert_parallel=True, worker_extension_cls=WORKER_EXTENSION)
    try:
        layouts = [pb.RankLayout.FromString(raw) for raw in llm.collective_rpc("rlsync_layout", args=(offer,))]
    finally:
        llm.llm_engine.engine_core.shutdown()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    return specs, layout_of(specs, layouts)


def _bytes(specs, held, which) -> int:
    return sum(4 * math.prod(b - a for a, b in box) for s, boxes in zip(specs, held) if which(s.name)
               for box in boxes)


def test_each_expert_parallel_worker_loads_only_its_own_experts_whole(ep_layouts):
    specs, layout = ep_layouts
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


def test_under_expert_parallelism_the_rest_is_still_tensor_parallel(ep_layouts):
    """Attention and the vocabulary split by TP as without EP; the router and norms held whole by both."""
    specs, layout = ep_layouts
    index = {s.name: i for i, s in enumerate(specs)}
    q = index["model.layers.0.self_attn.q_proj.weight"]
    rows = specs[q].shape[0]
    assert [list(layout.held[r][q]) for r in (0, 1)] == [[((0, rows // 2), (0, 64))], [((rows // 2, rows), (0, 64))]]
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"):
        whole = [tuple((0, d) for d in specs[index[name]].shape)]
        assert [list(layout.held[r][index[name]]) for r in (0, 1)] == [whole, whole], name
