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


def test_a_manifest_may_name_a_tensor_list_this_process_parsed():
    """A manifest without its tensors, named by its layout: refused (FAILED_PRECONDITION, which its
    sender answers by sending the list) until a manifest with that list was parsed here, then given
    that list; a manifest's own layout is not trusted; with_tensors writes the list out."""
    from rlsync.errors import UNKNOWN_LAYOUT, FailedPrecondition
    from rlsync.transfer.manifest import with_tensors

    full = build_manifest({"unseen.w": torch.zeros(5, 3), "unseen.b": torch.zeros(3, dtype=torch.bfloat16)}, 7)
    named = pb.Manifest(version=8, layout=full.layout)
    assert len(full.layout) == 16
    with pytest.raises(FailedPrecondition, match=UNKNOWN_LAYOUT):
        from_proto(named)
    specs = from_proto(pb.Manifest.FromString(full.SerializeToString()))  # as a replica receives it
    assert from_proto(named) == specs
    assert build_manifest({"unseen.w": torch.ones(5, 3), "unseen.b": torch.ones(3, dtype=torch.bfloat16)}, 9).layout \
        == full.layout  # the values do not count, nor the version
    assert build_manifest({"unseen.w": torch.zeros(5, 4)}, 7).layout != full.layout

    offer = pb.Offer(transfer_id="t", manifest=named, one_copy=True)
    written = with_tensors(offer)
    assert from_proto(written.manifest) == specs and written.manifest.version == 8 and written.transfer_id == "t"
    assert not offer.manifest.tensors  # a copy

    other = build_manifest({"unseen.other": torch.zeros(1)}, 1)
    lying = pb.Manifest.FromString(full.SerializeToString())
    lying.layout = other.layout  # read by its tensors, known by their digest: the claim is not taken on trust
    assert from_proto(lying) == specs
    with pytest.raises(FailedPrecondition, match=UNKNOWN_LAYOUT):
        from_proto(pb.Manifest(version=1, layout=other.layout))
