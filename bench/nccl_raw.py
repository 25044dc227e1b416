"""Raw NCCL of N bytes from rank 0 (the limit bench/transfer.py compares nccl against). Run one process
per GPU with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; rank 0 prints JSON.

    nccl_raw.py NBYTES [FORM]

FORM: broadcast (one call over all the bytes: the limit), buckets:B (broadcasts of B bytes back to back,
as rlsync's transfers cut them), sendrecv (rank 0 sends to each other rank in turn: its GB/s are one
receiver's bytes over the time for all)."""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

nbytes = int(sys.argv[1])
form = sys.argv[2] if len(sys.argv) > 2 else "broadcast"
if form not in ("broadcast", "sendrecv") and not form.startswith("buckets:"):
    sys.exit(f"unknown form {form!r}: broadcast, buckets:BYTES or sendrecv")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device(f"cuda:{rank}"))
buf = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
bucket = int(form.split(":")[1]) if form.startswith("buckets:") else nbytes
pieces = list(buf.split(bucket))


def move() -> None:
    if form == "sendrecv":
        if rank == 0:
            for peer in range(1, world):
                dist.send(buf, peer)
        else:
            dist.recv(buf, 0)
        return
    works = [dist.broadcast(p, 0, async_op=True) for p in pieces]
    for w in works:
        w.wait()


times = []
for i in range(5):
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    move()
    torch.cuda.synchronize()
    if i:
        times.append(time.perf_counter() - start)
if rank == 0:
    print(json.dumps({"bytes": nbytes, "form": form, "GB/s": nbytes / statistics.median(times) / 1e9}))
dist.destroy_process_group()
