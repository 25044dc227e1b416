"""Raw NCCL broadcast of N bytes from rank 0 (the limit bench/transfer.py compares nccl against).
Run one process per GPU with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; rank 0 prints JSON."""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

nbytes = int(sys.argv[1])
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device(f"cuda:{rank}"))
buf = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{rank}")
times = []
for i in range(4):
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    dist.broadcast(buf, 0)
    torch.cuda.synchronize()
    if i:
        times.append(time.perf_counter() - start)
if rank == 0:
    print(json.dumps({"bytes": nbytes, "GB/s": nbytes / statistics.median(times) / 1e9}))
dist.destroy_process_group()
