"""What a routed transfer's meeting reads from trainer rank 0's store, as the world grows: K trainer
ranks and K engine ranks, one of each per GPU (a colocated sharded trainer and tensor-parallel engines),
each trainer rank's RankMemory as FSDP2 leaves it (every parameter its own storage: one CUDA IPC
handle and one box each). Every member reads every trainer rank's summary; each engine rank also reads
the whole memory of the rank on its GPU. `before`: every member reads every rank's whole memory (what
the meeting did before summaries). Real TCPStore on loopback, members in --procs processes; no GPU.

    python bench/meeting_scale.py [--worlds 8,64,256] [--tensors 310] [--procs 8]

Per world and way: bytes the members read, and the wall time from the first read to the last member
done. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time

import torch.distributed as dist

from rlsync.transfer import pulls, sharded
from rlsync.transfer.control import Deadline
from rlsync.transfer.v1 import transfer_pb2 as pb

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
        nbytes += sum(x.ByteSize() for x in sharded._memories(store, OFFER, world, deadline))
        if m >= world:
            nbytes += sum(x.ByteSize() for x in sharded._held_memories(store, OFFER, [m - world], deadline).values())
    store.set(f"done/{members[0]}", str(nbytes))


def meeting(world: int, tensors: int, procs: int, before: bool) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    if before:  # every member reads every rank's whole memory
        pulls.summary = lambda memory: memory
    memory = rank_memory(0, tensors)
    for rank in range(world):
        sharded._put_memory(store, OFFER, rank, memory)
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), [int(m) for m in sys.argv[4].split(",")])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="8,64,256")
    parser.add_argument("--tensors", type=int, default=310)
    parser.add_argument("--procs", type=int, default=8)
    args = parser.parse_args()
    memory = rank_memory(0, args.tensors)
    cases = []
    for world in map(int, args.worlds.split(",")):
        for before in (False, True):
            out = subprocess.run([sys.executable, "-c", "import json, sys; sys.argv = [''];"
                                  f"import meeting_scale as m; print(json.dumps(m.meeting({world}, {args.tensors}, "
                                  f"{args.procs}, {before})))"],
                                 capture_output=True, text=True, cwd=sys.path[0], check=True)
            cases.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(cases[-1]), file=sys.stderr)
    print(json.dumps({"tensors": args.tensors, "procs": args.procs,
                      "summary_bytes": pulls.summary(memory).ByteSize(), "memory_bytes": memory.ByteSize(),
                      "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
