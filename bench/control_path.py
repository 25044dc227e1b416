"""Where the fixed cost of one update goes, piece by piece, outside the copy itself.

    python bench/control_path.py --device cuda --preset qwen3-1.7b
    python bench/control_path.py                                   # CPU, same tensor count, tiny shapes

Times (median of --repeats, in ms) each step the trainer and a replica take per update besides
moving bytes: on the trainer, building the source and sender after an onload and making the offer
(specs, manifest, facts, the CUDA memory description); on the replica, parsing the offer,
checking the manifest, answering and laying out the destination. Prints JSON.
"""

from __future__ import annotations

import argparse
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


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return round(statistics.median(runs) * 1e3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--repeats", type=int, default=20)
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
    r = args.repeats

    sender = WeightSender(ResidentSource(params))
    offer = sender.offer(version=1)
    raw = offer.SerializeToString()
    parsed = from_proto(offer.manifest)
    expected = {n: (tuple(s), None) for n, s in shapes.items()}
    source = sender.source
    trainer = {
        "source (after an onload)": timed(lambda: ResidentSource(params), r),
        "sender (after an onload)": timed(lambda: WeightSender(ResidentSource(params)).close(), r),
        "offer, first of a sender": timed(lambda: _first_offer(params), r),
        "offer, again": timed(lambda: sender.offer(version=2), r),
        "  specs": timed(lambda: source.specs(), r),
        "  manifest to protobuf": timed(lambda: to_proto(parsed, 1), r),
        "  describe the CUDA memory (fresh)": timed(lambda: describe_cuda(source.resident(), {}), r)
        if device.type == "cuda" else 0.0,
        "  serialize the offer": timed(lambda: offer.SerializeToString(), r),
    }
    replica = {
        "parse the offer": timed(lambda: pb.Offer.FromString(raw), r),
        "manifest from protobuf": timed(lambda: from_proto(offer.manifest), r),
        "check against the model": timed(lambda: check_against(parsed, expected), r),
        "answer": timed(lambda: answer(offer, "r0", device=device), r),
        "destination layout (DestWriter)": timed(lambda: DestWriter(parsed, dest, device), r),
        "destination layout, a FlatStore as the manifest": timed(lambda: DestWriter(parsed, store, device), r),
    }
    sender.close()
    print(json.dumps({"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                      "preset": args.preset, "tensors": len(shapes), "trainer_ms": trainer, "replica_ms": replica,
                      "trainer_total_ms": round(trainer["sender (after an onload)"]
                                                + trainer["offer, first of a sender"], 3),
                      "replica_total_ms": round(sum(v for k, v in replica.items() if "FlatStore" not in k), 3)},
                     indent=1))


def _first_offer(params) -> None:
    with WeightSender(ResidentSource(params)) as s:
        s.offer(version=1)


if __name__ == "__main__":
    main()
