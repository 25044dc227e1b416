"""What a sharded trainer rank spends describing the whole trainer's layout, as the world grows: the
boxes every rank holds of every parameter (rlsync.publish.layout.RankShards, made at each sender's
start: the first offer, and after every offload), then the routes from that layout to one whole copy
(its checksum shares). DTensors over a process group of the `fake` backend (torch's own, for one
process that plays a rank of many), shapes of a real model, no bytes. Prints one JSON object.

    python bench/layout_scale.py [--preset qwen3-1.7b] [--worlds 64,256,1024]

Meshes: FSDP over every rank (Shard(0)) up to 256 ranks; HSDP beyond (Replicate across groups of 8,
Shard(0) inside one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402

from rlsync.publish.layout import RankShards  # noqa: E402
from rlsync.publish.mapping import WeightMap  # noqa: E402
from rlsync.transfer.routes import share  # noqa: E402


def one_world(shapes: dict[str, tuple[int, ...]], world: int) -> dict:
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        hsdp = world > 256
        mesh = init_device_mesh("cpu", (world // 8, 8) if hsdp else (world,))
        placements = [Replicate(), Shard(0)] if hsdp else [Shard(0)]
        shards = 8 if hsdp else world
        params = {}
        for name, shape in shapes.items():
            local = torch.empty((-(-shape[0] // shards), *shape[1:]), dtype=torch.bfloat16, device="meta")
            params[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                              stride=torch.empty(shape, device="meta").stride())
        entries = WeightMap().plan([(n, tuple(t.shape), t.dtype) for n, t in params.items()])
        start = time.perf_counter()
        shards_of = RankShards(params, entries, 0, world)
        made = time.perf_counter()
        pieces = share(shards_of.layout, 0)
        return {"world": world, "mesh": list(mesh.mesh.shape), "tensors": len(entries),
                "layout_seconds": round(made - start, 3), "share_seconds": round(time.perf_counter() - made, 3),
                "pieces_of_rank_0": len(pieces)}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--worlds", default="64,256,1024")
    args = parser.parse_args()
    shapes = preset_shapes(args.preset)
    out = {"preset": args.preset, "cases": [one_world(shapes, int(w)) for w in args.worlds.split(",")]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
