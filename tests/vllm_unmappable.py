"""rlsync's vLLM worker extension in a worker that may not map other processes' CUDA memory, as between two
containers without a shared IPC namespace: torch's mapping call raises what it raises there. A test names it
as the replica's `worker_extension_cls` (with this folder on PYTHONPATH); everything else is rlsync's own."""

import torch

from rlsync.rollout.engines.vllm_worker import RlsyncWorkerExtension


def _refused(*args, **kwargs):
    raise RuntimeError("CUDA error: invalid resource handle (injected: no IPC between this worker and the sender)")


torch.UntypedStorage._new_shared_cuda = staticmethod(_refused)


class UnmappableExtension(RlsyncWorkerExtension):
    pass
