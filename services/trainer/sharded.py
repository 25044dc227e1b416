"""The policy sharded with FSDP2 over the trainer's ranks (`--nproc N`): one process per rank, each
holding 1/N of the parameters, gradients and optimizer state (gloo on CPU, NCCL with a GPU each, gloo
where ranks share a GPU).

The same surface as `Policy` for the trainer core: model, params, optimizer, offload/onload.
Parameters are DTensors; every rank sends its own shards when the weights go out (rlsync.publish).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlsync.errors import FailedPrecondition
from rlsync.models import load_trainable


class ShardedPolicy:
    def __init__(self, model_path: str, device: str, dtype: str, lr: float, weight_decay: float):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        model = load_trainable(model_path, dtype).to(self.device)
        mesh = init_device_mesh(self.device.type, (world,))
        for layer in getattr(getattr(model, "model", None), "layers", []):  # decoder blocks: one unit each
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.model.train()
        self.params = dict(self.model.named_parameters())  # DTensors with the global shapes
        self.trainable = self.params  # no LoRA on a sharded trainer yet: every parameter trains
        self.specs = {n: (p.shape, p.dtype) for n, p in self.params.items()}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=weight_decay)
        self.arena = None  # shards are never mapped by a receiver: every rank sends its own pieces
        self.offloaded = False

    def reference_model_params(self):
        raise FailedPrecondition("a KL penalty to the initial policy (--kl-coef) is not available with --nproc > 1")

    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def device_bytes(self) -> int:
        """This rank's share: parameters, gradients and optimizer state on the training device."""
        total = 0
        for p in self.params.values():
            total += p.to_local().numel() * p.element_size()
            if p.grad is not None:
                total += p.grad.to_local().numel() * p.grad.element_size()
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    local = v.to_local() if hasattr(v, "to_local") else v
                    total += local.numel() * local.element_size() if local.device == self.device else 0
        return total

    # ---- offload / onload: each rank moves its shards (a GPU's go to host memory) --------------------
    def offload(self) -> None:
        if self.offloaded:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
        self.offloaded = True

    def onload(self) -> None:
        if not self.offloaded:
            return
        if self.device.type == "cuda":
            self._move(self.device)
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(device)

    def close(self) -> None:
        pass
