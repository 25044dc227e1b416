"""One rank of a 2-rank check (RANK / WORLD_SIZE / MASTER_* set by the test): weights row-sharded as FSDP2
shards them (blocks cut by the boundary, uneven, fewer rows than ranks) are quantized per rank with
rlsync.quant.fp8_shards over gloo; each rank compares its FP8 rows and owned scale rows with the reference
quantizer of the whole tensor, bit for bit, and prints one JSON line."""

import json

import torch
import torch.distributed as dist

from rlsync.quant.fp8_blocks import quantize_blocks
from rlsync.quant.fp8_shards import fsdp_row_ranges, quantize_row_shard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
shapes = [(300, 200), (256, 128), (130, 64), (1, 300), (129, 129), (520, 260)]
wrong, checked = [], []
for pow2 in (False, True):
    for m, n in shapes:
        whole = (torch.randn(m, n) * torch.logspace(-3, 2, m).unsqueeze(1)).to(torch.bfloat16)
        whole[m // 2] *= 1000  # the largest value of a cut block on one rank only
        ranges = fsdp_row_ranges(m, world)
        start, stop = ranges[rank]
        q, s, owned = quantize_row_shard(whole[start:stop].clone(), ranges, rank, n, pow2=pow2)
        q_ref, s_ref = quantize_blocks(whole, pow2=pow2)
        ok = torch.equal(q.view(torch.uint8), q_ref[start:stop].view(torch.uint8)) and \
            torch.equal(s.view(torch.int32), s_ref[owned.start:owned.stop].view(torch.int32))
        (checked if ok else wrong).append(f"{m}x{n} pow2={pow2}")
print(json.dumps({"rank": rank, "wrong": wrong, "checked": checked}))
dist.destroy_process_group()
