"""One rank of a user's FSDP2 loop (gloo, CPU) over the tiny FP8 Qwen3, trained in fp32 and published as
bf16 to a replica that holds its linear layers in block FP8: every rank quantizes the rows it holds and
sends them straight to the replica (routed). After each publish every rank gathers the whole weights (a
test's check, never rlsync's way) and rank 0 compares what the replica serves with the reference
quantizer of them, bit for bit: one JSON line a step."""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from rlsync.client import RolloutClient
from rlsync.publish import WeightMap, WeightPublisher
from rlsync.quant.fp8_blocks import quantize_blocks
from rlsync.quant.fp8_format import scale_name
from rlsync.transfer import audit_entry

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", required=True)
parser.add_argument("--replica", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
replica = RolloutClient(args.replica) if rank == 0 else None
fp8 = list(replica.info().weight_format.fp8.weights) if rank == 0 else []

with WeightPublisher(model, args.coordinator, weights=WeightMap(dtype=torch.bfloat16), bucket_bytes=65536) as pub:
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        sync = pub.publish(step, verify=True)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            served = {t.name: t for t in replica.checksums().tensors}
            wrong, checked = [], 0
            for w in fp8:
                q, s = quantize_blocks(full[w].to(torch.bfloat16))
                for name, t in ((w, q), (scale_name(w), s)):
                    dtype, _, checksum = audit_entry(t)
                    checked += 1
                    if (served[name].dtype, served[name].checksum) != (dtype, checksum):
                        wrong.append(name)
            print(json.dumps({"step": step, "version": sync.version, "verified": sync.verified, "bytes": sync.bytes,
                              "rank_bytes": list(sync.trainer_rank_bytes), "weights": len(fp8), "checked": checked,
                              "wrong": wrong, "served_version": replica.info().weight_version,
                              "served": sorted(served[n].checksum for w in fp8 for n in (w, scale_name(w)))}),
                  flush=True)
dist.barrier()
dist.destroy_process_group()
