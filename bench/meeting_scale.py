"""What every member of a routed transfer spends meeting the others, as the world grows: K trainer
ranks (FSDP2, a real model's shapes) and K engine ranks (K / 8 replicas of TP=8), one of each per GPU
(a colocated sharded trainer and tensor-parallel engines). No GPU.

The store: each trainer rank's RankMemory as FSDP2 leaves it (every parameter its own storage: one
CUDA IPC handle and one box each). Every member reads every trainer rank's summary; each engine rank
also reads the whole memory of the rank on its GPU. `before`: every member reads every rank's whole
memory (what the meeting did before summaries). Real TCPStore on loopback, members in --procs
processes: bytes read, and the wall time from the first read to the last member done.

The trainer's layout: its size, which every offer carried to every replica and worker before offers
named it by digest (now each receiver process reads it once from the store). The roster every
receiver rank reads at every transfer: its size (`answers_MB`: before, every answer with every rank's
layout; now each distinct layout once).

Planning: the routes planned once per membership (the first transfer, and after a replica joins or
leaves), then what each member pays again at every transfer with the plan cached (a trainer rank: the
engine's layout from the answers; rank 0: the roster; a receiver rank: the engine's layout from the
roster; every member: the cached plan's lookup, the split into pulled and pushed pairs).

    python bench/meeting_scale.py [--worlds 8,64,256] [--preset qwen3-1.7b] [--procs 8]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402

from rlsync.transfer import pulls, sharded  # noqa: E402
from rlsync.transfer.control import Deadline  # noqa: E402
from rlsync.transfer.manifest import Spec  # noqa: E402
from rlsync.transfer.routes import TensorInfo, cached_routes, chunk, layout, plan_routes  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402

TP = 8

OFFER = pb.Offer(transfer_id="meeting")


def rank_memory(rank: int, tensors: int) -> pb.RankMemory:
    handle = pb.CudaIpcHandle(device=0, handle=bytes(64), storage_size_bytes=1 << 24,
                              ref_counter_handle=f"/torch_{rank}_1234567_0".encode(), ref_counter_offset=rank,
                              event_handle=bytes(64), event_sync_required=True).SerializeToString()
    return pb.RankMemory(facts=pb.Facts(host_id="host", device_type="cuda", gpu_uuids=[f"GPU-{rank}"]),
                         ipc=[handle] * tensors, regions=tensors, groups=["group"],
                         held=[pb.RankMemory.Held(region=i, offset=0, stride=[2048, 1], dtype="bfloat16")
                               for i in range(tensors)])


def worker(address: str, world: int, members: list[int]) -> None:
    """Members < world are trainer ranks (summaries); the rest engine ranks (summaries, then the whole
    memory of the trainer rank on their GPU)."""
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=600))
    store.set(f"ready/{members[0]}", b"")
    store.wait(["go"])
    nbytes = 0
    for m in members:
        deadline = Deadline(600, "meeting")
        summaries = sharded._memories(store, OFFER, world, deadline)
        nbytes += sum(x.ByteSize() for x in summaries)
        if m >= world:  # (each rank's memory its own digest: every member's first meeting of it)
            nbytes += sum(x.ByteSize() for x in sharded._held_memories(store, summaries, [m - world],
                                                                       deadline).values())
    store.set(f"done/{members[0]}", str(nbytes))


def meeting(world: int, tensors: int, procs: int, before: bool) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    if before:  # every member reads every rank's whole memory
        pulls.summary = lambda memory: memory
    for rank in range(world):
        sharded._put_memory(store, OFFER, rank, *sharded._export(rank_memory(rank, tensors)))
    shares = [list(range(2 * world))[p::procs] for p in range(procs)]
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", f"127.0.0.1:{store.port}", str(world),
                                 ",".join(map(str, s))]) for s in shares if s]
    done = [f"done/{s[0]}" for s in shares if s]
    store.wait([f"ready/{s[0]}" for s in shares if s], datetime.timedelta(seconds=600))
    start = time.perf_counter()
    store.set("go", b"1")
    store.wait(done, datetime.timedelta(seconds=600))
    seconds = time.perf_counter() - start
    for w in workers:
        w.wait()
    read = sum(int(v) for v in store.multi_get(done))
    return {"world": world, "way": "before" if before else "now", "members": 2 * world,
            "MB_read": round(read / 1e6, 2), "seconds": round(seconds, 3)}


def _rows(shape: tuple[int, ...], n: int, i: int) -> list:
    a, b = chunk(shape[0], n, i)
    return [((a, b), *((0, d) for d in shape[1:]))] if b > a else []


def planning(world: int, shapes: dict[str, tuple[int, ...]], repeats: int = 5) -> dict:
    """Seconds to plan the routes once; milliseconds each member pays again at every transfer."""
    infos = [TensorInfo(n, tuple(s), 2) for n, s in shapes.items()]
    specs = [Spec(n, torch.bfloat16, tuple(s), 2 * math.prod(s)) for n, s in shapes.items()]
    trainer = layout(infos, [[_rows(t.shape, world, r) for t in infos] for r in range(world)])
    tp_rank = [sharded.to_layout_proto([_rows(t.shape, TP, r) for t in infos]) for r in range(TP)]
    answers = [pb.Answer(receiver_id=f"replica-{i}", ranks=TP, layout=[
        pb.RankLayout(tensors=t.tensors,
                      facts=pb.Facts(host_id="host", device_type="cuda", gpu_uuids=[f"GPU-{i * TP + r}"]))
        for r, t in enumerate(tp_rank)]) for i in range(world // TP)]
    memories = [pb.RankMemory(facts=pb.Facts(host_id="host", device_type="cuda", gpu_uuids=[f"GPU-{r}"]), regions=1)
                for r in range(world)]
    start = time.perf_counter()
    engine = sharded.engine_layout(specs, answers)
    routes = plan_routes(trainer, engine)
    first = time.perf_counter() - start
    cached_routes(trainer, engine)
    receivers = sharded.engine_facts(answers)
    roster = sharded.make_roster(answers)

    def again(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return round((time.perf_counter() - start) / repeats * 1e3, 2)

    held = pb.TrainerLayout(ranks=[sharded.to_layout_proto(r) for r in trainer.held])
    return {"world": world, "replicas": world // TP, "pieces": sum(len(t.pieces) for t in routes.transfers),
            "trainer_layout_MB": round(held.ByteSize() / 1e6, 3), "roster_MB": round(roster.ByteSize() / 1e6, 3),
            "answers_MB": round(pb.RoutedSend(answers=answers).ByteSize() / 1e6, 3), "plan_seconds": round(first, 3),
            "per_transfer_ms": {"engine_layout": again(lambda: sharded.engine_layout(specs, answers)),
                                "make_roster": again(lambda: sharded.make_roster(answers)),
                                "roster_layout": again(lambda: sharded.roster_layout(
                                    specs, pb.Roster.FromString(roster.SerializeToString()))),
                                "cached_routes": again(lambda: cached_routes(trainer, engine)),
                                "split": again(lambda: pulls.split(routes, memories, receivers))}}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), [int(m) for m in sys.argv[4].split(",")])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="8,64,256")
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--procs", type=int, default=8)
    args = parser.parse_args()
    shapes = preset_shapes(args.preset)
    args.tensors = len(shapes)
    memory = rank_memory(0, args.tensors)
    plans = []
    for world in map(int, args.worlds.split(",")):
        plans.append(planning(world, shapes))
        print(json.dumps(plans[-1]), file=sys.stderr)
    cases = []
    for world in map(int, args.worlds.split(",")):
        for before in (False, True):
            out = subprocess.run([sys.executable, "-c", "import json, sys; sys.argv = [''];"
                                  f"import meeting_scale as m; print(json.dumps(m.meeting({world}, {args.tensors}, "
                                  f"{args.procs}, {before})))"],
                                 capture_output=True, text=True, cwd=sys.path[0], check=True)
            cases.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(cases[-1]), file=sys.stderr)
    print(json.dumps({"preset": args.preset, "tensors": args.tensors, "procs": args.procs, "planning": plans,
                      "summary_bytes": pulls.summary(memory).ByteSize(), "memory_bytes": memory.ByteSize(),
                      "store": cases}, indent=1))


if __name__ == "__main__":
    main()
