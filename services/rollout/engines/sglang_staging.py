"""The SGLang replica's staging: one memfd its scheduler processes map (rlsync.rollout.engines.sglang_scheduler), the
manifest's tensors packed in it."""

from __future__ import annotations

import torch

from rlsync.checkpoint_names import Unstacked
from rlsync.flat import FlatStore
from rlsync.rollout.engines.sglang_scheduler import Tensor
from rlsync.transfer.dtypes import dtype_name
from rlsync.transfer.memory import SharedArena


class SharedStaging:
    """Staging tensors in one memfd the scheduler process maps: the manifest's tensors, packed; handed to the model
    under the checkpoint's names (a stacked experts tensor as its experts' tensors, `stack`), audited under the
    manifest's."""

    def __init__(self, specs, stack: Unstacked):
        nbytes = sum(s.nbytes for s in specs) + SharedArena.ALIGN * (len(specs) + 1)
        self.arena = SharedArena(chunk_bytes=max(nbytes, 1))
        self.store = FlatStore({s.name: (torch.Size(s.shape), s.dtype) for s in specs},
                               allocate=lambda n, dtype: self.arena.empty(n, dtype))
        self.tensors, self.audited = [], []
        for i, s in enumerate(specs):
            view = self.store.views[s.name]
            place = self.arena.locate(view) if view.numel() else (0, 0)
            self.audited.append(Tensor(s.name, dtype_name(s.dtype), list(s.shape), place[1]))
            members = stack.members.get(i, ())
            self.tensors.extend(Tensor(stack.flat[j].name, dtype_name(s.dtype), list(stack.flat[j].shape),
                                       place[1] + m * stack.flat[j].nbytes) for m, j in enumerate(members))
            if not members:
                self.tensors.append(self.audited[-1])
        if not stack.members:
            self.audited = []  # (the same names: the loaded tensors are audited)
        self.fd = self.arena.buffers[0].fd if self.arena.buffers else -1

    def nbytes(self) -> int:
        return self.arena.buffers[0].nbytes if self.arena.buffers else 0

    def close(self) -> None:
        self.arena.close()
