"""The per-update work a sharded trainer's ranks do besides sending bytes, on the CPU: a request from rank 0 to the
others (`Ranks.broadcast`, by payload size: a routed send's request carries the offer and the replicas' answers),
the gather of a small description, and one rank's share of a verified update's checksums (`RankShards.checksum_share`,
FSDP2, the tiny MoE with 28 experts against the dense tiny: 189 pieces against 26). Each against its limit measured in
the same run: a raw gloo broadcast of the same bytes; a sum of the same bytes as one tensor. Prints one JSON object.

    python bench/rank_requests.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import timeit

import torch
import torch.distributed as dist

PAYLOADS = (0, 40, 1000, 20_000, 100_000)  # bytes: none (a pass), a format, ..., a MoE's routed send, a large one


def _median_us(fn, repeats: int) -> float:
    """Median microseconds of fn(), after a tenth as many calls to warm up."""
    timeit.repeat(fn, number=1, repeat=max(repeats // 10, 5))
    return round(statistics.median(timeit.repeat(fn, number=1, repeat=repeats)) * 1e6, 1)


def requests(repeats: int) -> dict | None:
    """Two gloo ranks (this process is one of them): a request of each payload size, the raw broadcast of as many
    bytes, a gather of 80 bytes. -> (rank 0) the medians in microseconds."""
    from rlsync.publish.ranks import BROADCAST_FIRST, Ranks

    dist.init_process_group("gloo")
    ranks, out = Ranks(), {}
    for size in PAYLOADS:
        payload = bytes(size) if ranks.rank == 0 else b""
        raw = torch.zeros(max(size, 1) + 24, dtype=torch.uint8)
        request = _median_us(functools.partial(ranks.broadcast, 9, 0, payload), repeats)
        limit = _median_us(functools.partial(dist.broadcast, raw, 0), repeats)
        out[str(size)] = {"request_us": request, "raw_broadcast_us": limit, "ratio": round(request / limit, 2),
                          "collectives": 1 if size <= BROADCAST_FIRST - 24 else 2}
    gather = _median_us(lambda: ranks.gather(b"d" * 80), repeats)
    dist.barrier()
    dist.destroy_process_group()
    return {"request_by_payload_bytes": out, "gather_80_bytes_us": gather} if ranks.rank == 0 else None


def checksum_shares(repeats: int) -> dict:
    """One rank's share of the checksums (a process group of one, FSDP2), MoE against dense."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from rlsync.models import TinyMoeRecipe, ensure_tiny_model, ensure_tiny_moe
    from rlsync.publish import WeightMap
    from rlsync.publish.source import module_source

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    out = {}
    for name, path in (("moe", ensure_tiny_moe(TinyMoeRecipe(num_experts=28))), ("dense", ensure_tiny_model())):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        fully_shard(model)
        source, _ = module_source(model, WeightMap(dtype=torch.float32))
        shards = source.shards
        whole = torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()])
        share = _median_us(shards.checksum_share, repeats)
        limit = _median_us(functools.partial(torch.sum, whole.view(torch.int32)), repeats)
        out[name] = {"tensors": len(source.specs), "bytes": whole.numel() * whole.element_size(), "share_us": share,
                     "one_sum_us": limit, "ratio": round(share / limit, 1)}
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # (a rank this script started)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.rank >= 0:
        result = requests(args.repeats)
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--repeats", str(args.repeats)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    print(json.dumps({"host_cores": os.cpu_count(), **result, "checksum_share": checksum_shares(args.repeats // 5)}))


if __name__ == "__main__":
    main()
