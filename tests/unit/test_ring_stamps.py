"""RLSYNC_STAMP_DIR: a doorbell ring's points, written by both its ends, line up on one clock in the
order the ring passes them (bench/ring_stamps.py); unset, nothing is written."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rlsync.common import stamps
from rlsync.rollout.v1 import rollout_pb2 as pb
from rlsync.rpc.doorbell import DoorbellServer, Lines
from rlsync.transfer.handshake import host_id
from rlsync.transfer.v1 import transfer_pb2 as tpb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from ring_stamps import rings, steps  # noqa: E402


async def _prepare(request: pb.PrepareUpdateRequest) -> pb.PrepareUpdateResponse:
    return pb.PrepareUpdateResponse(answer=tpb.Answer(receiver_id="r0", transfer_id=request.offer.transfer_id))


def _ring_three_times() -> None:
    from rlsync.client.weights import ring_prepare

    async def main():
        server = DoorbellServer({"PrepareUpdate": (pb.PrepareUpdateRequest.FromString, _prepare)}, "t", "r0")
        bell = tpb.Doorbell(host_id=host_id(), address=await server.start(), name="r0")
        lines = Lines()
        try:
            for version in (1, 2, 3):
                offer = tpb.Offer(transfer_id=f"t{version}", manifest=tpb.Manifest(version=version))
                rung, _ = await ring_prepare(offer, [bell], "t", lines=lines)
                assert rung[0].rung
        finally:
            lines.close()
            await server.close()

    asyncio.run(main())


def test_a_rings_points_line_up_in_its_order(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSYNC_STAMP_DIR", str(tmp_path / "stamps"))
    monkeypatch.setattr(stamps, "_out", None)
    monkeypatch.setattr(stamps, "_decided", False)
    _ring_three_times()
    found = rings(tmp_path / "stamps")
    assert len(found) == 3
    for r in found:  # (no pull here: nothing launched, no copy waited for)
        names = sorted(r, key=r.get)
        assert names == ["ring", "written", "read", "parsed", "replied", "answered"], names
    assert set(steps(found)) == {"ring->written", "written->read", "read->parsed", "parsed->replied",
                                 "replied->answered"}
    assert all(s["rings"] == 3 and 0 <= s["min_ms"] <= s["median_ms"] for s in steps(found).values())


def test_unset_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("RLSYNC_STAMP_DIR", raising=False)
    monkeypatch.setattr(stamps, "_out", None)
    monkeypatch.setattr(stamps, "_decided", False)
    monkeypatch.chdir(tmp_path)
    _ring_three_times()
    assert stamps._decided and stamps._out is None and not any(tmp_path.iterdir())
