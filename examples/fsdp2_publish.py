"""An FSDP2 training loop over N ranks that publishes its weights to the fleet after every step.

    torchrun --nproc-per-node 2 examples/fsdp2_publish.py --coordinator 127.0.0.1:50050

Every rank builds the model, shards it with fully_shard and trains; every rank calls publish(),
and every rank sends its own shards straight to the engine ranks that load them (gloo on CPU, NCCL on GPU). The loss
here is plain next-token prediction on random tokens: bring your own.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from rlsync.models import resolve_model
from rlsync.publish import WeightMap, WeightPublisher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", default=os.environ.get("RLSYNC_COORDINATOR", "127.0.0.1:50050"),
                        help="coordinator address (default: $RLSYNC_COORDINATOR, which `rlsync up` sets)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--after-step", type=int, default=0,
                        help="the fleet's version to go on from: steps are numbered from the next one (replicas "
                             "refuse a version older than the one they serve)")
    parser.add_argument("--publish-dtype", default="", help="cast on the way out, e.g. bfloat16 (default: as trained)")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    parser.add_argument("--verify", action="store_true", help="compare the replicas' checksums after each sync")
    parser.add_argument("--keep-going", action="store_true",
                        help="a step whose publish failed is reported and training goes on (the replicas keep "
                             "the version they had; the next publish carries the newer weights)")
    parser.add_argument("--save", default="", help="rank 0 writes the full state dict here (safetensors) at the end")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank

    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    if cuda:
        model.cuda()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    weights = WeightMap(dtype=getattr(torch, args.publish_dtype) if args.publish_dtype else None)
    with WeightPublisher(model, args.coordinator, weights=weights, bucket_bytes=args.bucket_bytes) as pub:
        for step in range(args.after_step + 1, args.after_step + args.steps + 1):
            tokens = torch.randint(0, model.config.vocab_size, (4, 32), device="cuda" if cuda else "cpu")
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            try:
                sync = pub.publish(step, verify=args.verify)  # every rank; rank 0 gets the coordinator's answer
            except Exception as e:  # raised on every rank alike
                if not args.keep_going:
                    raise
                if rank == 0:
                    print(json.dumps({"step": step, "failed": str(e)}), flush=True)
                continue
            if rank == 0:
                print(json.dumps({"step": step, "loss": round(loss.item(), 4), "version": sync.version,
                                  "sync_seconds": round(sync.seconds, 4), "bytes": sync.bytes,
                                  "rank_bytes": list(sync.trainer_rank_bytes),
                                  "verified": sync.verified}), flush=True)
        if args.save:
            from safetensors.torch import save_file
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                save_file({k: v.contiguous() for k, v in full.items()}, args.save)
    # Every rank leaves together: gloo can abort a rank that tears its group down while another
    # still works (here rank 0 writing the file), with "terminate called without an active exception".
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
