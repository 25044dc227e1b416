"""How fast bytes go from GPU 0 to GPU 1, by each way there is: NCCL's broadcast in one call (the limit
the disaggregated cycle is held to), the same cut into rlsync's buckets, under other NCCL settings,
NCCL's send/recv, and a copy engine's peer copy in one process that sees both GPUs (NVLink with no
NCCL at all). Each as GB/s and as a ratio to the one-call broadcast of the same run. Prints one JSON
object.

    python bench/nccl_forms.py [--bytes 3441185608] [--bucket 268435456]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import nccl_limit  # noqa: E402


def peer_copy(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one copy_ from GPU 0 into GPU 1 (a peer copy over NVLink where the GPUs have one)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        if i:
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=float, default=3441185608)  # Qwen3-1.7B in bf16, as bench/gpu_cycle.py
    parser.add_argument("--bucket", type=int, default=256 << 20)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("nccl_forms.py needs 2 GPUs")
    nbytes = int(args.bytes)
    forms = [("broadcast", "broadcast", {}),
             ("buckets", f"buckets:{args.bucket}", {}),
             ("buckets_simple_protocol", f"buckets:{args.bucket}", {"NCCL_PROTO": "Simple"}),
             ("buckets_32_channels", f"buckets:{args.bucket}", {"NCCL_MIN_NCHANNELS": "32"}),
             ("sendrecv", "sendrecv", {}),
             ("sendrecv_copy_engine", "sendrecv", {"NCCL_P2P_USE_CUDA_MEMCPY": "1"})]
    out = {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "bytes": nbytes,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "forms": []}
    for name, form, env in forms:
        try:
            rate = nccl_limit(nbytes, 2, form, env)
        except Exception as e:  # noqa: BLE001 - a setting this NCCL refuses: reported, the rest still run
            out["forms"].append({"name": name, "form": form, "env": env, "error": repr(e)})
            continue
        out["forms"].append({"name": name, "form": form, "env": env, "GB/s": round(rate, 1)})
    base = out["forms"][0].get("GB/s")
    out["peer_copy_GB/s"] = round(peer_copy(nbytes), 1)
    if base:
        for f in out["forms"]:
            if "GB/s" in f:
                f["vs_broadcast"] = round(f["GB/s"] / base, 3)
        out["peer_copy_vs_broadcast"] = round(out["peer_copy_GB/s"] / base, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
