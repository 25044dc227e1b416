"""The SGLang replica's staging (one memfd its scheduler maps): a stacked experts tensor is handed to the model as
its experts' checkpoint tensors, each a run of the staged bytes, and audited under the manifest's names; anything else
under its own. Real shared memory, mapped back through /proc as the scheduler process maps it."""

from __future__ import annotations

import os

import torch

from rlsync.checkpoint_names import Unfuse, stacked_specs
from rlsync.rollout.engines.sglang_staging import SharedStaging
from rlsync.rollout.engines.sglang_scheduler import Request, request_tensors
from rlsync.transfer.manifest import Spec

GATE_UP = Unfuse("mlp.experts.gate_up_proj", ("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"))
E, R, H = 3, 4, 5


def _mapped(staging: SharedStaging, which) -> dict[str, torch.Tensor]:
    request = Request(reply="", pid=os.getpid(), fd=staging.fd, nbytes=staging.nbytes(), tensors=staging.tensors)
    return dict(request_tensors(request, which))


def test_a_stacked_tensor_is_loaded_as_its_experts_runs_and_audited_under_its_own_name():
    name = "m.mlp.experts.gate_up_proj"
    specs = (Spec("m.norm.weight", torch.float32, (H,), 4 * H), Spec(name, torch.float32, (E, 2, R, H), 8 * E * R * H))
    staging = SharedStaging(specs, stacked_specs(specs, [GATE_UP]))
    try:
        stacked = torch.arange(E * 2 * R * H, dtype=torch.float32).view(E, 2, R, H)
        staging.store.views[name].copy_(stacked)
        staging.store.views["m.norm.weight"].fill_(7)
        loaded = _mapped(staging, staging.tensors)
        assert list(loaded)[:3] == ["m.norm.weight", *(f"m.mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj"))]
        assert len(loaded) == 1 + 2 * E
        for e in range(E):
            for k, proj in enumerate(("gate_proj", "up_proj")):
                assert torch.equal(loaded[f"m.mlp.experts.{e}.{proj}.weight"], stacked[e, k]), (e, proj)
        audited = _mapped(staging, staging.audited)
        assert list(audited) == ["m.norm.weight", name] and torch.equal(audited[name], stacked)
    finally:
        staging.close()


def test_a_manifest_of_the_checkpoints_own_names_is_loaded_and_audited_as_it_is():
    specs = (Spec("m.norm.weight", torch.float32, (H,), 4 * H), Spec("m.w", torch.bfloat16, (R, H), 2 * R * H))
    staging = SharedStaging(specs, stacked_specs(specs, [GATE_UP]))
    try:
        assert [t.name for t in staging.tensors] == ["m.norm.weight", "m.w"] and staging.audited == []
    finally:
        staging.close()
