"""Weight audits: per-tensor checksums as protobuf, and comparing two of them."""

from __future__ import annotations

from rlsync.common.v1 import weights_pb2 as pb

LIVE = "live parameters"  # the source of an audit read from the weights in use


def trainer_dtype(served: pb.WeightChecksums) -> str:
    """The dtype to ask the trainer's audit in, to compare with `served`: live parameters are in the
    engine's dtype; tensors applied by an update ("" here) are as the trainer sent them."""
    return served.tensors[0].dtype if served.tensors and served.source == LIVE else ""


def to_proto(version: int, sums: dict[str, tuple[str, tuple[int, ...], str]], source: str) -> pb.WeightChecksums:
    """sums: {name: (dtype, shape, checksum)}. (Each tensor added in place: a mixture of experts audits hundreds,
    at every verified update, and a message made apart and copied in costs twice as much.)"""
    out = pb.WeightChecksums(version=version, source=source)
    add = out.tensors.add
    for n, (d, s, c) in sums.items():
        add(name=n, dtype=d, shape=s, checksum=c)
    return out


def differences(expected: pb.WeightChecksums, actual: pb.WeightChecksums) -> list[str]:
    """What differs between two audits ([] means the same weights, tensor for tensor)."""
    want = {t.name: t for t in expected.tensors}
    got = {t.name: t for t in actual.tensors}
    out = [f"missing {n!r}" for n in sorted(set(want) - set(got))]
    out += [f"unexpected {n!r}" for n in sorted(set(got) - set(want))]
    for name in sorted(set(want) & set(got)):
        a, b = want[name], got[name]
        if a.dtype != b.dtype:
            out.append(f"{name!r}: dtype {a.dtype} vs {b.dtype} (ask the trainer for dtype={b.dtype!r})")
        elif a.checksum != b.checksum:
            out.append(f"{name!r}: checksum {a.checksum} vs {b.checksum}")
    return out
