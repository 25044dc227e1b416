"""One member of a routed transfer (started by a test), through the library's two ends (ShardedSender,
RoutedReceiver): ROLE=trainer ranks hold DTensor shards of every placement a trainer may use (FSDP2's
fully_shard among them) and send what the routes ask of them; ROLE=engine ranks are one replica's
tensor-parallel ranks, which load the boxes such an engine loads and check them bit for bit against
the whole tensors. DEVICE=cuda puts every member on one GPU (receiver ranks then pull); DEVICE=cuda:i
puts this member on GPU i (pairs on one GPU pull, the others go over NCCL). Trainer rank 0
hosts a board (ROUTED_STORE) where the offer and the replica's answer are passed. TRANSFERS updates
(2 by default) run one after the other in the same processes, into the same staging, as a trainer and a
replica do (the receiver keeps its writer and how it landed each bucket with the staging; STEPS:
the trainer changes every value in place between them; HOLD: engine ranks keep its memory mapped; FP8: the
replica holds embed, qk and o in block FP8, whose blocks the trainer's shards cut by rows, fused parts and
columns, and checks them against the reference quantizer of the whole tensors). Every member prints one
JSON line: the last transfer's outcome, and the routed group each transfer used."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from rlsync.publish import WeightMap
from rlsync.publish.quantized import quantized
from rlsync.publish.ranks import Ranks
from rlsync.publish.source import module_source
from rlsync.quant.fp8_blocks import quantize_blocks
from rlsync.quant.fp8_format import scale_name
from rlsync.transfer import answer, routed_groups
from rlsync.transfer.handshake import local_facts
from rlsync.transfer.held import HELD
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.routes import TensorInfo, chunks, layout, plan_routes, volume, whole
from rlsync.transfer.sharded import RoutedReceiver, to_layout_proto
from rlsync.transfer.v1 import transfer_pb2 as pb

ROLE, K, G = os.environ["ROLE"], int(os.environ["SENDERS"]), int(os.environ["RECEIVERS"])
RANK = int(os.environ["RANK"])
STORE = os.environ["ROUTED_STORE"]  # host:port of the board; trainer rank 0 hosts it
BUCKET = int(os.environ.get("BUCKET", 1 << 12))
TRANSFERS = int(os.environ.get("TRANSFERS", 2))
HOLD = os.environ.get("HOLD", "")  # engine ranks keep what they pull mapped under this holder name
STEPS = bool(os.environ.get("STEPS"))  # the trainer adds 1 to every parameter in place before each later transfer
DEVICE = torch.device(os.environ.get("DEVICE", "cpu"))
FP8 = bool(os.environ.get("FP8"))  # blocks of 16 x 12: cut by every trainer layout below
FORMAT = pb.WeightFormat(fp8=pb.Fp8Blocks(fmt="e4m3", block=[16, 12], scale_dtype="float32",
                                          weights=["embed", "qk", "o"]))
if DEVICE.index is not None:
    torch.cuda.set_device(DEVICE)


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
    return m.to(DEVICE)


WEIGHTS = WeightMap(dtype=torch.bfloat16, fuse={"qk": ["q", "k"]})


def engine_layout(entries):
    """What each of G tensor-parallel ranks loads, as vLLM lays a decoder out: vocabulary and fused
    projections by rows, the output projection by columns, norms, scalars (and FP8 scales) whole."""
    infos = [TensorInfo(e.name, tuple(e.shape), e.dtype.itemsize) for e in entries]
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
    host, port = STORE.rsplit(":", 1)
    board = dist.TCPStore(host, int(port), is_master=ROLE == "trainer" and RANK == 0, wait_for_workers=False)
    if ROLE == "trainer":
        trainer(whole_model, entries, board)
    else:
        engine(whole_model, entries, board)
    os._exit(0)  # see dtensor_worker.py: gloo's threads may still hold work objects at finalization


def trainer(whole_model, entries, board):
    dist.init_process_group("cpu:gloo,cuda:gloo" if DEVICE.type == "cuda" else "gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh(DEVICE.type, (K,))
    sharded = model()
    scalar = sharded.scalar
    del sharded.scalar  # FSDP2 refuses 0-dim parameters: it stays a plain tensor on every rank
    fully_shard(sharded, mesh=mesh)  # FSDP2: Shard(0) on every parameter ...
    sharded.scalar = scalar
    o = whole_model.o.detach()
    columns = slice(*chunks(o.shape[1], K)[RANK])
    with torch.no_grad():  # ... but o by columns and norm replicated, as tensor parallel would
        sharded.o = nn.Parameter(DTensor.from_local(o[:, columns].contiguous(), mesh, [Shard(1)], run_check=False,
                                                    shape=o.shape, stride=o.stride()))
        sharded.norm = nn.Parameter(DTensor.from_local(whole_model.norm.detach().clone(), mesh, [Replicate()],
                                                       run_check=False))
    module, entries = module_source(sharded, WEIGHTS)  # in the manifest's order
    if FP8:
        module = quantized(module, FORMAT)
    sender = module.sender(bucket_bytes=BUCKET)
    groups = []
    for i in range(TRANSFERS):
        if RANK == 0:
            board.set(f"offer/{i}", sender.offer(version=i + 1).SerializeToString())
        if STEPS and i:
            with torch.no_grad():  # a training step: new values, at the same addresses
                for p in sharded.parameters():
                    p.add_(1.0)
        offer = pb.Offer.FromString(board.get(f"offer/{i}"))
        ans = pb.Answer.FromString(board.get(f"answer/{i}"))
        start = time.perf_counter()
        module.refresh(Ranks())  # every rank, in step, before it sends (as PublisherCore does)
        report = sender.send(offer, [ans], timeout=60)
        groups.append(last_group())
    routes = plan_routes(module.shards.layout, engine_layout(module.specs))
    pairs = [sum(p.nbytes(routes.tensors) for p in t.pieces) for t in routes.of_sender(RANK)]
    print(json.dumps({"role": ROLE, "rank": RANK, "sent": report.wire_bytes, "planned": routes.sent_bytes()[RANK],
                      "largest_pair": max(pairs, default=0),
                      "held": module.shards.layout.nbytes(RANK), "channels": report.backends,
                      "layout_as_expected": FP8 or module.shards.layout == trainer_layout(entries),
                      "seconds": time.perf_counter() - start, "groups": groups}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def engine(whole_model, entries, board):
    """One rank of a tensor-parallel replica: rank 0 answers for all of them, with every rank's boxes."""
    groups, held = [], []  # ... and the mappings this process keeps, after each transfer
    staging, keep = {}, {}  # one staging for every transfer, and what the receiver keeps with it (a FlatStore's memo)
    for i in range(TRANSFERS):
        offer = pb.Offer.FromString(board.get(f"offer/{i}"))
        specs = from_proto(offer.manifest)  # laid out as the manifest lists them (in FP8 with the scales)
        mine = engine_layout(specs).held[RANK]
        board.set(f"layout/{i}/{RANK}", to_layout_proto(mine, local_facts(DEVICE)).SerializeToString())
        if RANK == 0:
            layouts = [pb.RankLayout.FromString(board.get(f"layout/{i}/{e}")) for e in range(G)]
            board.set(f"answer/{i}", answer(offer, "replica", device=DEVICE, ranks=G, layout=layouts)
                      .SerializeToString())
        ans = pb.Answer.FromString(board.get(f"answer/{i}"))
        for e, boxes in zip(specs, mine):  # NaN before each transfer, in place: each must land every value again
            if boxes:
                nan = torch.full(tuple(b - a for a, b in boxes[0]), float("nan"), device=DEVICE).to(e.dtype)
                staging.setdefault(e.name, torch.empty_like(nan)).copy_(nan)
        boxes = {e.name: boxes[0] for e, boxes in zip(specs, mine) if boxes}
        report = RoutedReceiver(offer, ans, staging, rank=RANK, device=DEVICE, timeout=60, boxes=boxes,
                                hold=HOLD, keep=keep).run()
        groups.append(last_group())
        held.append(HELD.count())
    HELD.release(HOLD)
    step = TRANSFERS - 1 if STEPS else 0
    params = {n: p.detach() + step for n, p in whole_model.named_parameters()}
    full = {e.name: (torch.cat([params[p] for p in e.parts]) if len(e.parts) > 1 else
                     params[e.parts[0]]).to(e.dtype) for e in entries}
    for w in FORMAT.fp8.weights if FP8 else ():  # the reference quantizer of the whole tensor, on this device
        full[w], full[scale_name(w)] = quantize_blocks(full[w], tuple(FORMAT.fp8.block))
    wrong = [n for n, t in staging.items() if not _same(t, full[n][tuple(slice(a, b) for a, b in boxes[n])]
                                                         if boxes[n] else full[n])]
    print(json.dumps({"role": ROLE, "rank": RANK, "received": report.nbytes, "channels": report.backends,
                      "loads": engine_layout(specs).nbytes(RANK), "wrong": wrong,
                      "tensors": sorted(staging), "groups": groups, "held": held,
                      "held_after_release": HELD.count(), "profile": report.profile}), flush=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


def last_group() -> str:
    """The routed group this process used last ("" where every pair pulled and none formed)."""
    held = routed_groups.held()
    return held[-1] if held else ""


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
