"""Manifests: what a transfer moves (names, dtypes, shapes, byte sizes, version), as protobuf."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from rlsync.errors import InvalidArgument
from rlsync.transfer.checksum import checksum_tensor
from rlsync.transfer.dtypes import dtype_name, dtype_of, itemsize
from rlsync.transfer.v1 import transfer_pb2 as pb


class Spec(NamedTuple):  # a tuple: built hundreds of times per update, it must be cheap
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    checksum: str = ""

    @classmethod
    def of(cls, name: str, t: torch.Tensor, checksum: bool = False) -> Spec:
        return cls(name, t.dtype, tuple(t.shape), t.numel() * t.element_size(),
                   checksum_tensor(t) if checksum else "")


def build_manifest(tensors: Mapping[str, torch.Tensor], version: int, checksums: bool = False) -> pb.Manifest:
    return to_proto([Spec.of(n, t, checksums) for n, t in tensors.items()], version)


def to_proto(specs: Sequence[Spec], version: int, fmt: pb.WeightFormat | None = None) -> pb.Manifest:
    """fmt: the format the sender quantized to, or stacked experts in (Manifest.format), if any."""
    global _LAST_LIST
    last = _LAST_LIST
    if last[0] is not specs:  # (a sender offers its own tuple at every step: not even hashed again)
        last = _LAST_LIST = (specs if type(specs) is tuple else None), _tensor_list(tuple(specs))
    manifest = pb.Manifest.FromString(last[1])
    manifest.version = version
    if fmt is not None and (fmt.HasField("fp8") or fmt.stacked_experts):
        manifest.format.CopyFrom(fmt)
    return manifest


def from_proto(manifest: pb.Manifest) -> tuple[Spec, ...]:
    """Specs of a received manifest; refuses one that is inconsistent with itself. The same tensors give the same
    tuple (kept by their bytes): what is keyed by them is found by identity at the next update."""
    raw = manifest.SerializeToString()
    rest = pb.Manifest(version=manifest.version)  # what follows the tensors when serialized
    if manifest.HasField("adapter"):
        rest.adapter.CopyFrom(manifest.adapter)
    if manifest.HasField("format"):
        rest.format.CopyFrom(manifest.format)
    tail = rest.SerializeToString()
    return _parsed(raw[:len(raw) - len(tail)] if raw.endswith(tail) else raw)


_LAST_LIST: tuple = (None, b"")  # the last tuple of specs to_proto listed, and its tensor list


# A trainer offers the same tensors at every step, and a replica parses each offer more than once:
# the last few tensor lists are kept, built and checked, keyed by their bytes (cheap to make).
@lru_cache(maxsize=4)
def _tensor_list(specs: tuple[Spec, ...]) -> bytes:
    return pb.Manifest(tensors=[
        pb.TensorSpec(name=s.name, dtype=dtype_name(s.dtype), shape=list(s.shape), nbytes=s.nbytes,
                      checksum=s.checksum) for s in specs]).SerializeToString()


@lru_cache(maxsize=4)
def _parsed(raw: bytes) -> tuple[Spec, ...]:
    specs, seen = [], set()
    for t in pb.Manifest.FromString(raw).tensors:
        name, shape, nbytes = t.name, tuple(t.shape), t.nbytes
        if not name:
            raise InvalidArgument("manifest has a tensor without a name")
        if name in seen:
            raise InvalidArgument(f"manifest names tensor {name!r} twice")
        seen.add(name)
        dtype = dtype_of(t.dtype)
        if shape and min(shape) < 0:
            raise InvalidArgument(f"tensor {name!r} has a negative dimension {list(shape)}")
        expected = math.prod(shape) * itemsize(dtype)
        if expected != nbytes:
            raise InvalidArgument(f"tensor {name!r}: shape {list(shape)} of {t.dtype} is {expected} bytes, "
                                  f"manifest says {nbytes}")
        specs.append(Spec(name, dtype, shape, nbytes, t.checksum))
    return tuple(specs)


def check_against(specs: list[Spec], expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]]) -> None:
    """Refuses a manifest that does not fit a receiver: unknown names, missing names, wrong shapes
    or (when the receiver pins one) wrong dtypes. Says every problem at once, so one fix suffices."""
    problems = []
    names = {s.name for s in specs}
    for s in specs:
        if s.name not in expected:
            problems.append(f"unknown tensor {s.name!r}")
            continue
        shape, dtype = expected[s.name]
        if tuple(shape) != s.shape:
            problems.append(f"{s.name!r} has shape {list(s.shape)}, expected {list(shape)}")
        if dtype is not None and dtype != s.dtype:
            problems.append(f"{s.name!r} has dtype {dtype_name(s.dtype)}, expected {dtype_name(dtype)}")
    missing = sorted(set(expected) - names)
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(repr(m) for m in missing[:5])}"
                        + (" ..." if len(missing) > 5 else ""))
    if problems:
        raise InvalidArgument("manifest does not match the receiver's model: " + "; ".join(problems[:10])
                              + (f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""))
