"""Manifests: every dtype by name, self-consistency, and matching a receiver's model."""

import pytest
import torch

from rlsync.errors import InvalidArgument
from rlsync.transfer.dtypes import DTYPES
from rlsync.transfer.manifest import build_manifest, check_against, from_proto
from rlsync.transfer.v1 import transfer_pb2 as pb


def test_roundtrip_every_dtype():
    tensors = {name: torch.zeros(2, 3, dtype=dtype) for name, dtype in DTYPES.items()}
    tensors["scalar"] = torch.tensor(1.5)
    tensors["empty"] = torch.zeros(0, 4)
    manifest = build_manifest(tensors, version=9, checksums=True)
    specs = from_proto(pb.Manifest.FromString(manifest.SerializeToString()))
    assert manifest.version == 9
    for spec, (name, t) in zip(specs, tensors.items()):
        assert (spec.name, spec.dtype, spec.shape) == (name, t.dtype, tuple(t.shape))
        assert spec.nbytes == t.numel() * t.element_size() and spec.checksum


@pytest.mark.parametrize("spec, fragment", [
    (pb.TensorSpec(name="a", dtype="float32", shape=[2], nbytes=7), "is 8 bytes, manifest says 7"),
    (pb.TensorSpec(name="a", dtype="float33", shape=[2], nbytes=8), "unknown dtype 'float33'"),
    (pb.TensorSpec(name="", dtype="float32", shape=[2], nbytes=8), "without a name"),
    (pb.TensorSpec(name="a", dtype="float32", shape=[-2], nbytes=8), "negative dimension"),
])
def test_inconsistent_manifest_is_refused(spec, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        from_proto(pb.Manifest(tensors=[spec]))


def test_duplicate_names_refused():
    t = pb.TensorSpec(name="a", dtype="float32", shape=[1], nbytes=4)
    with pytest.raises(InvalidArgument, match="twice"):
        from_proto(pb.Manifest(tensors=[t, t]))


def test_check_against_reports_every_problem_at_once():
    specs = from_proto(build_manifest({"w": torch.zeros(2, 3), "extra": torch.zeros(1), "b": torch.zeros(3)}, 1))
    expected = {"w": ((3, 2), None), "b": ((3,), torch.bfloat16), "missing": ((1,), None)}
    with pytest.raises(InvalidArgument) as e:
        check_against(specs, expected)
    msg = str(e.value)
    for fragment in ("unknown tensor 'extra'", "'w' has shape [2, 3], expected [3, 2]",
                     "'b' has dtype float32, expected bfloat16", "missing 1 tensor(s): 'missing'"):
        assert fragment in msg
