"""Where the fixed cost of one update goes, piece by piece, outside the copy itself.

    python bench/control_path.py --device cuda --preset qwen3-1.7b
    python bench/control_path.py                                   # CPU, same tensor count, tiny shapes
    python bench/control_path.py --cold                            # each step as an update meets it

Times (median of --repeats, in ms) each step the trainer and a replica take per update besides
moving bytes: on the trainer, building the source and sender after an onload and making the offer
(specs, manifest, facts, the CUDA memory description); on the replica, parsing the offer,
checking the manifest, answering and laying out the destination; and a doorbell ring of the offer,
from its start to the handler entered (the server in this process). --cold: before each run, 64 MiB
are written and the process idles 0.2 s, as the path runs once per update beside other work (caches
and the core's clock cold); hot, it runs in a loop. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import PRESETS, decoder_shapes  # noqa: E402

from rlsync.flat import FlatStore  # noqa: E402
from rlsync.transfer import WeightSender, answer, check_against, from_proto  # noqa: E402
from rlsync.transfer.backends.slots import describe_cuda  # noqa: E402
from rlsync.transfer.manifest import to_proto  # noqa: E402
from rlsync.transfer.source import ResidentSource  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402
from rlsync.transfer.writer import DestWriter  # noqa: E402


COLD = bytearray(64 << 20)


def chill() -> None:
    """What an update meets between two: 64 MiB of other work through the caches, and 0.2 s idle."""
    COLD[:] = bytes(len(COLD))
    time.sleep(0.2)


def timed(fn, repeats: int, cold: bool = False) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        if cold:
            chill()
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return round(statistics.median(runs) * 1e3, 4)


def ring_ms(offer: pb.Offer, repeats: int, cold: bool) -> float:
    """A PrepareUpdate ring of `offer` (the trainer's ring_prepare), from its start to the doorbell's
    handler entered, in ms: the trainer's request, the socket, the replica's parse."""
    from rlsync.client.weights import ring_prepare
    from rlsync.rollout.v1 import rollout_pb2
    from rlsync.rpc.doorbell import DoorbellServer, Lines
    from rlsync.transfer.handshake import host_id

    entered: list[float] = []

    async def prepare(request):
        entered.append(time.perf_counter())
        return rollout_pb2.PrepareUpdateResponse(answer=pb.Answer(receiver_id="r0"))

    async def run() -> float:
        server = DoorbellServer({"PrepareUpdate": (rollout_pb2.PrepareUpdateRequest.FromString, prepare)}, "t", "r0")
        doorbell = pb.Doorbell(host_id=host_id(), address=await server.start(), name="r0")
        lines, runs = Lines(), []
        try:
            for _ in range(repeats + 1):
                if cold:
                    chill()  # (nothing else runs on this loop)
                start = time.perf_counter()
                await ring_prepare(offer, [doorbell], "t", lines=lines)
                runs.append(entered[-1] - start)
        finally:
            lines.close()
            await server.close()
        return round(statistics.median(runs[1:]) * 1e3, 4)

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cold", action="store_true", help="each run with caches and clock cold (see above)")
    args = parser.parse_args()
    dims = dict(PRESETS[args.preset])
    if args.device == "cpu":  # the same tensors, tiny: the per-tensor costs are what is measured
        dims.update(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000)
    shapes = decoder_shapes(**dims)
    device = torch.device(args.device)
    specs = {n: (torch.Size(s), torch.bfloat16) for n, s in shapes.items()}
    params = FlatStore(specs, device).views  # as the trainer keeps them
    store = FlatStore(specs, device)  # as the hf engine keeps its weights (and receives into them)
    dest = store.views
    r, cold = args.repeats, args.cold

    sender = WeightSender(ResidentSource(params))
    offer = sender.offer(version=1)
    raw = offer.SerializeToString()
    parsed = from_proto(offer.manifest)
    expected = {n: (tuple(s), None) for n, s in shapes.items()}
    source = sender.source
    trainer = {
        "source (after an onload)": timed(lambda: ResidentSource(params), r, cold),
        "sender (after an onload)": timed(lambda: WeightSender(ResidentSource(params)).close(), r, cold),
        "offer, first of a sender": timed(lambda: _first_offer(params), r, cold),
        "offer, again": timed(lambda: sender.offer(version=2), r, cold),
        "  specs": timed(lambda: source.specs(), r, cold),
        "  manifest to protobuf": timed(lambda: to_proto(parsed, 1), r, cold),
        "  describe the CUDA memory (fresh)": timed(lambda: describe_cuda(source.resident(), {}), r, cold)
        if device.type == "cuda" else 0.0,
        "  serialize the offer": timed(lambda: offer.SerializeToString(), r, cold),
        "ring the offer (to the handler entered)": ring_ms(offer, r, cold),
    }
    replica = {
        "parse the offer": timed(lambda: pb.Offer.FromString(raw), r, cold),
        "manifest from protobuf": timed(lambda: from_proto(offer.manifest), r, cold),
        "check against the model": timed(lambda: check_against(parsed, expected), r, cold),
        "answer": timed(lambda: answer(offer, "r0", device=device), r, cold),
        "destination layout (DestWriter)": timed(lambda: DestWriter(parsed, dest, device), r, cold),
        "destination layout, a FlatStore as the manifest": timed(lambda: DestWriter(parsed, store, device), r, cold),
    }
    sender.close()
    print(json.dumps({"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                      "preset": args.preset, "tensors": len(shapes), "cold": cold, "trainer_ms": trainer,
                      "replica_ms": replica,
                      "trainer_total_ms": round(trainer["sender (after an onload)"]
                                                + trainer["offer, first of a sender"], 3),
                      "replica_total_ms": round(sum(v for k, v in replica.items() if "FlatStore" not in k), 3)},
                     indent=1))


def _first_offer(params) -> None:
    with WeightSender(ResidentSource(params)) as s:
        s.offer(version=1)


if __name__ == "__main__":
    main()
