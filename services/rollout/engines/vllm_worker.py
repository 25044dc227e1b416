"""rlsync's vLLM worker extension: methods vLLM mixes into each worker, reached with collective_rpc.

Registered through vLLM's public `worker_extension_cls` engine argument; arguments and results are
plain ints, strings and dicts (tensors do not cross the engine's process boundary).
"""

from __future__ import annotations

from typing import Any

import torch


class RlsyncWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (self.model_runner, self.device, ...)."""

    def rlsync_memory(self) -> dict[str, Any]:
        model = self.model_runner.get_model()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = 0
        for cache in getattr(self.model_runner, "kv_caches", []) or []:
            tensors = cache if isinstance(cache, (list, tuple)) else [cache]
            kv += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        device = next(model.parameters()).device
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        return {"device": str(device), "weights_bytes": weights, "kv_cache_bytes": kv, "reserved_bytes": reserved}
