"""One rank of a 2-rank check (RANK / WORLD_SIZE / MASTER_* set by the test): weights row-sharded as FSDP2
shards them (blocks cut by the boundary, uneven, fewer rows than ranks) are quantized per rank with
rlsync.quant.fp8_shards, the cut blocks' amaxes combined by a real all-reduce MAX over gloo; each rank
compares its FP8 rows and the scales it sends with the reference quantizer of the whole tensor, bit for
bit, and prints one JSON line."""

import json

import torch
import torch.distributed as dist

from rlsync.quant.fp8_blocks import quantize_blocks, scales_of
from rlsync.quant.fp8_shards import block_plan, exchange, partial_amax, quantize_box
from rlsync.transfer.routes import chunks


def max_of(t):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
shapes = [(300, 200), (256, 128), (130, 64), (1, 300), (129, 129), (520, 260)]
wrong, checked = [], []
for pow2 in (False, True):
    wholes = []
    for m, n in shapes:
        whole = (torch.randn(m, n) * torch.logspace(-3, 2, m).unsqueeze(1)).to(torch.bfloat16)
        whole[m // 2] *= 1000  # the largest value of a cut block on one rank only
        wholes.append(whole)
    held = [tuple(((((a, b), (0, n)),) if b > a else ()) for a, b in chunks(m, world)) for m, n in shapes]
    plans = [block_plan((m, n), h) for (m, n), h in zip(shapes, held)]
    mine = [h[rank] for h in held]
    amaxes = [partial_amax([(b, w[b[0][0]:b[0][1]]) for b in boxes], w.shape) for w, boxes in zip(wholes, mine)]
    exchange(amaxes, plans, max_of)  # one all-reduce for every weight
    for whole, boxes, plan, amax in zip(wholes, mine, plans, amaxes):
        q_ref, s_ref = quantize_blocks(whole, pow2=pow2)
        scale = scales_of(amax, pow2)
        ok = all(torch.equal(quantize_box(whole[r0:r1], b, scale).view(torch.uint8), q_ref[r0:r1].view(torch.uint8))
                 for b in boxes for (r0, r1) in [b[0]])
        ok = ok and all(torch.equal(scale[a:z].view(torch.int32), s_ref[a:z].view(torch.int32))
                        for (a, z), _ in plan.owned[rank])
        (checked if ok else wrong).append(f"{list(whole.shape)} pow2={pow2}")
print(json.dumps({"rank": rank, "wrong": wrong, "checked": checked}))
dist.destroy_process_group()
