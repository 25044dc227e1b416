"""rlsync's end inside each SGLang scheduler process (where SGLang keeps the model): SGLang imports
`load` by the dotted path the replica names as its custom weight loader, and calls it between two
batches with this rank's model. The tensor list it is handed carries no weights, only a request in
its one name ("rlsync:" + JSON): the weights lie in the rollout process's staging memory (memfd,
mapped here through /proc), received there over rlsync's own channels while the engine served the
old ones. The reply goes to the file the request names (SGLang's call returns nothing).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgspec
import torch

PREFIX = "rlsync:"
LOADER = "rlsync.rollout.engines.sglang_scheduler.load"


class Tensor(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int  # bytes into the staging buffer


class Request(msgspec.Struct):
    reply: str  # where this rank writes its Reply (the rank's index appended)
    pid: int = 0  # the rollout process holding the staging memfd
    fd: int = -1
    nbytes: int = 0
    tensors: list[Tensor] = []  # what the model loads (the checkpoint's names)
    audited: list[Tensor] = []  # the same bytes under the names the trainer sent, where they differ (stacked experts)


class Reply(msgspec.Struct):
    ok: bool
    error: str = ""
    applied: dict[str, tuple[str, list[int], str]] = {}  # name -> (dtype, shape, checksum) of what was loaded


def request_tensors(request: Request, which: list[Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The staged tensors (`which`, else the request's), mapped from the rollout process's memfd (no copy until
    load_weights)."""
    from rlsync.transfer.dtypes import dtype_of, itemsize
    from rlsync.transfer.memory import SharedBuffer

    raw = SharedBuffer.attach(os.open(f"/proc/{request.pid}/fd/{request.fd}", os.O_RDWR), request.nbytes).tensor
    out = []
    for t in request.tensors if which is None else which:
        dtype = dtype_of(t.dtype)
        size = math.prod(t.shape) * itemsize(dtype)
        out.append((t.name, raw[t.offset:t.offset + size].view(dtype).view(t.shape)))
    return out


def load(model, named_tensors) -> None:
    (name, _), = named_tensors
    request = msgspec.json.decode(name[len(PREFIX):], type=Request)
    try:
        from rlsync.transfer import audit

        tensors = request_tensors(request)
        model.load_weights(tensors)
        applied = audit(dict(request_tensors(request, request.audited) if request.audited else tensors))
        reply = Reply(True, applied={n: (d, list(s), c) for n, (d, s, c) in applied.items()})
    except Exception as e:  # noqa: BLE001 - the rollout process raises it, with this message
        reply = Reply(False, error=f"{type(e).__name__}: {e}")
    Path(f"{request.reply}.{_rank()}").write_bytes(msgspec.json.encode(reply))


def _rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - one rank
        return 0
