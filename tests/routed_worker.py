"""One member of a routed transfer (started by a test): ROLE=trainer ranks hold DTensor shards of every
placement a trainer may use (FSDP2's fully_shard among them) and send what the routes ask of them;
ROLE=engine ranks receive the boxes a tensor-parallel engine loads and check them bit for bit against
the whole tensors. Every member prints one JSON line."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from rlsync.publish import WeightMap
from rlsync.publish.layout import RankShards
from rlsync.transfer import routed
from rlsync.transfer.control import Deadline
from rlsync.transfer.manifest import Spec
from rlsync.transfer.routes import TensorInfo, chunks, layout, plan_routes, volume, whole
from rlsync.transfer.writer import DestWriter

ROLE, K, G = os.environ["ROLE"], int(os.environ["SENDERS"]), int(os.environ["RECEIVERS"])
RANK = int(os.environ["RANK"])
STORE = os.environ["ROUTED_STORE"]  # host:port; trainer rank 0 hosts it
BUCKET = int(os.environ.get("BUCKET", 1 << 12))


def model() -> nn.Module:
    """Whole tensors, the same in every process (seeded)."""
    torch.manual_seed(0)
    m = nn.Module()
    m.embed = nn.Parameter(torch.randn(37, 16))  # vocabulary rows, not a multiple of the ranks
    m.q = nn.Parameter(torch.randn(32, 16))  # fused with k into "qk" for the engine
    m.k = nn.Parameter(torch.randn(8, 16))
    m.o = nn.Parameter(torch.randn(16, 32))  # row parallel on the engine: columns
    m.norm = nn.Parameter(torch.randn(16))  # replicated on the engine
    m.scalar = nn.Parameter(torch.randn(()))
    m.empty = nn.Parameter(torch.randn(0, 4))
    return m


WEIGHTS = WeightMap(dtype=torch.bfloat16, fuse={"qk": ["q", "k"]})


def engine_layout(entries):
    """What each of G tensor-parallel ranks loads, as vLLM lays a decoder out: vocabulary and fused
    projections by rows, the output projection by columns, norms and scalars whole."""
    infos = [TensorInfo(e.name, e.shape, 2) for e in entries]
    held = []
    for e in range(G):
        boxes = []
        for entry in entries:
            box = list(whole(entry.shape))
            if entry.name in ("embed", "qk"):
                box[0] = chunks(entry.shape[0], G)[e]
            elif entry.name == "o":
                box[1] = chunks(entry.shape[1], G)[e]
            boxes.append([tuple(box)] if volume(tuple(box)) else [])
        held.append(boxes)
    return layout(infos, held)


def main():
    whole_model = model()
    entries = WEIGHTS.plan([(n, tuple(p.shape), p.dtype) for n, p in whole_model.named_parameters()])
    specs = [Spec(e.name, e.dtype, e.shape, volume(whole(e.shape)) * 2) for e in entries]
    host, port = STORE.rsplit(":", 1)
    deadline = Deadline(60, "routed transfer")
    if ROLE == "trainer":
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (K,))
        sharded = model()
        scalar = sharded.scalar
        del sharded.scalar  # FSDP2 refuses 0-dim parameters: it stays a plain tensor on every rank
        fully_shard(sharded, mesh=mesh)  # FSDP2: Shard(0) on every parameter ...
        sharded.scalar = scalar
        with torch.no_grad():  # ... but o by columns and norm replicated, as tensor parallel would
            sharded.o = nn.Parameter(distribute_tensor(whole_model.o.detach(), mesh, [Shard(1)]))
            sharded.norm = nn.Parameter(distribute_tensor(whole_model.norm.detach(), mesh, [Replicate()]))
        params = dict(sharded.named_parameters())
        shards = RankShards(params, entries, RANK, K)
        routes = plan_routes(shards.layout, engine_layout(entries))
        store = dist.TCPStore(host, int(port), is_master=RANK == 0, wait_for_workers=False)
        pg = routed.group(store, "test", RANK, K + G, torch.device("cpu"), 60)
        start = time.perf_counter()
        sent = routed.send(pg, routes, RANK, shards.piece, BUCKET, deadline, torch.device("cpu"))
        print(json.dumps({"role": ROLE, "rank": RANK, "sent": sent, "planned": routes.sent_bytes()[RANK],
                          "held": shards.layout.nbytes(RANK),
                          "layout_as_expected": shards.layout == trainer_layout(entries),
                          "seconds": time.perf_counter() - start}), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    else:
        # The engine needs only the trainer's layout, which it computes from the shapes and placements
        # (here: as the trainer ranks make them, without their processes).
        trainer = trainer_layout(entries)
        routes = plan_routes(trainer, engine_layout(entries))
        mine = engine_layout(entries).held[RANK]
        staging = {e.name: (boxes[0], torch.full(tuple(b - a for a, b in boxes[0]), float("nan"), dtype=e.dtype))
                   for e, boxes in zip(entries, mine) if boxes}
        piece_specs, views = routed.destinations(routes, RANK, specs, staging)
        writer = DestWriter(piece_specs, views, torch.device("cpu"))
        store = dist.TCPStore(host, int(port), is_master=False)
        pg = routed.group(store, "test", K + RANK, K + G, torch.device("cpu"), 60)
        received = routed.receive(pg, routes, RANK, writer, BUCKET, deadline, torch.device("cpu"))
        full = {e.name: torch.cat([dict(whole_model.named_parameters())[p].detach() for p in e.parts]).to(e.dtype)
                if len(e.parts) > 1 else dict(whole_model.named_parameters())[e.parts[0]].detach().to(e.dtype)
                for e in entries}
        wrong = [n for n, (box, t) in staging.items()
                 if not torch.equal(t, full[n][tuple(slice(a, b) for a, b in box)] if box else full[n])]
        print(json.dumps({"role": ROLE, "rank": RANK, "received": received,
                          "loads": engine_layout(entries).nbytes(RANK), "wrong": wrong,
                          "tensors": sorted(staging)}), flush=True)
    os._exit(0)  # see dtensor_worker.py: gloo's threads may still hold work objects at finalization


def trainer_layout(entries):
    """The layout RankShards computes on each trainer rank (FSDP2 rows, o by columns, norm replicated)."""
    infos = [TensorInfo(e.name, e.shape, 2) for e in entries]
    held = []
    for r in range(K):
        boxes = []
        for e in entries:
            if e.name == "qk":
                q, k = chunks(32, K)[r], chunks(8, K)[r]
                boxes.append([b for b in (((q[0], q[1]), (0, 16)), ((32 + k[0], 32 + k[1]), (0, 16))) if volume(b)])
            elif e.name == "o":
                boxes.append([((0, 16), chunks(32, K)[r])])
            elif e.name in ("norm", "scalar"):
                boxes.append([whole(e.shape)])
            else:
                box = (chunks(e.shape[0], K)[r], *whole(e.shape)[1:])
                boxes.append([box] if volume(box) else [])
        held.append(boxes)
    return layout(infos, held)


if __name__ == "__main__":
    sys.exit(main())
