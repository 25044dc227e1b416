"""What copying a user's model tensor by tensor costs on one GPU, against one copy of the same bytes:
the part of a scattered pull left once its storages stay mapped (rlsync.transfer.held). The copies
alone, no transfer library around them: from this process's own memory, and from another process's
memory mapped by CUDA IPC (as a replica pulls from its trainer).

    python bench/scatter_copy.py [--preset qwen3-4b] [--repeats 5]

Ways: "flat" (one copy of every byte: the limit), "per_tensor" (a copy_ per tensor), "foreach_u8"
(torch._foreach_copy_ over every tensor as bytes), "foreach_wide" (the same over 8-byte words, where
a tensor's address and size allow), "hybrid" (foreach for tensors under 1 MiB, a copy_ each for the
rest: copy_all without its table), "table" (one kernel launch over a table of chunks:
rlsync.transfer.batched, what copy_all does on a GPU), and the table's variants (chunk bytes, words
a step, warps; "table_best" is the fastest). Each is timed from the first launch to the device's
synchronize, medians of `--repeats` after a warm-up; the launch time (CPU) is reported beside it.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402
from transfer import d2d_limit, make_tensors  # noqa: E402

from rlsync.transfer.memory import export_cuda, open_cuda  # noqa: E402
from rlsync.transfer import batched  # noqa: E402
from rlsync.transfer.batched import BLOCK, CHUNK, WARPS  # noqa: E402
from rlsync.transfer.spans import copy_all  # noqa: E402

GB = 1e9
SMALL = 1 << 20


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median seconds to the synchronize, median seconds of launching) after one warm-up."""
    fn()
    torch.cuda.synchronize()
    total, launch = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        total.append(time.perf_counter() - start)
        launch.append(launched - start)
    return statistics.median(total), statistics.median(launch)


def wide(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as int64 words when its address and size allow, else as bytes."""
    return t.view(torch.int64) if t.data_ptr() % 8 == 0 and t.numel() % 8 == 0 else t


def ways(srcs: list[torch.Tensor], dsts: list[torch.Tensor], repeats: int) -> dict:
    """Times every way of copying srcs into dsts (uint8 views, one device)."""
    nbytes = sum(t.numel() for t in srcs)
    small = [i for i, t in enumerate(srcs) if t.numel() < SMALL]
    wide_src, wide_dst = [wide(t) for t in srcs], [wide(t) for t in dsts]
    same = [i for i in range(len(srcs)) if wide_src[i].dtype == wide_dst[i].dtype]

    def per_tensor():
        for s, d in zip(srcs, dsts):
            d.copy_(s, non_blocking=True)

    def foreach_wide():
        torch._foreach_copy_([wide_dst[i] for i in same], [wide_src[i] for i in same], non_blocking=True)
        for i in set(range(len(srcs))) - set(same):
            dsts[i].copy_(srcs[i], non_blocking=True)

    out = {"small_tensors": len(small), "wide_tensors": len(same)}
    for d in dsts:
        d.zero_()
    copy_all(list(zip(srcs, dsts)))  # one launch over a table (rlsync.transfer.batched)
    out["table_exact"] = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    pairs = list(zip(srcs, dsts))
    for chunk, block, warps in itertools.product((1 << 18, 1 << 20, 1 << 22), (1024, 2048, 4096), (4, 8)):
        batched.CHUNK, batched.BLOCK, batched.WARPS = chunk, block, warps
        seconds, launch = timed(lambda: copy_all(pairs), repeats)
        out.setdefault("table_variants", []).append({"chunk": chunk, "block": block, "warps": warps,
                                                     "ms": round(seconds * 1e3, 3), "GB/s": nbytes / seconds / GB})
    best = min(out["table_variants"], key=lambda v: v["ms"])
    batched.CHUNK, batched.BLOCK, batched.WARPS = CHUNK, BLOCK, WARPS
    for name, fn in {"per_tensor": per_tensor, "table": lambda: copy_all(pairs),
                     "hybrid": lambda: copy_all(pairs, one_launch=False),
                     "foreach_u8": lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True),
                     "foreach_wide": foreach_wide}.items():
        seconds, launch = timed(fn, repeats)
        out[name] = {"ms": round(seconds * 1e3, 3), "launch_ms": round(launch * 1e3, 3), "GB/s": nbytes / seconds / GB}
    out["table_best"] = best
    out["copied_exactly"] = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    return out


def child(preset: str, repeats: int) -> None:
    """Maps the parent's tensors (handles on stdin, one per line) and copies out of them."""
    shapes = preset_shapes(preset)
    device = torch.device("cuda", 0)
    mapped = [open_cuda(bytes.fromhex(line.strip()), device) for line, _ in zip(sys.stdin, shapes)]
    srcs = [m[:m.numel()] for m in mapped]
    dsts = [t.view(-1).view(torch.uint8) for t in make_tensors(shapes, "cuda:0", "flat").values()]
    srcs = [s[:d.numel()] for s, d in zip(srcs, dsts)]
    print(json.dumps(ways(srcs, dsts, repeats)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.preset, args.repeats)
    shapes = preset_shapes(args.preset)
    src = make_tensors(shapes, "cuda:0", "scattered")
    dst = make_tensors(shapes, "cuda:0", "flat")
    srcs = [t.view(-1).view(torch.uint8) for t in src.values()]
    dsts = [t.view(-1).view(torch.uint8) for t in dst.values()]
    nbytes = sum(t.numel() for t in srcs)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    flat_dst = torch.empty_like(flat_src)
    limit = d2d_limit(4 << 30, "cuda:0")
    out = {"gpu": torch.cuda.get_device_name(0), "preset": args.preset, "bytes": nbytes, "tensors": len(srcs),
           "d2d_copy_GB_s": round(limit, 1)}
    seconds, launch = timed(lambda: flat_dst.copy_(flat_src, non_blocking=True), args.repeats)
    out["flat"] = {"ms": round(seconds * 1e3, 3), "launch_ms": round(launch * 1e3, 3), "GB/s": nbytes / seconds / GB}
    out["own_memory"] = ways(srcs, dsts, args.repeats)
    del dst
    torch.cuda.synchronize()
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--preset", args.preset, "--repeats",
                             str(args.repeats)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    handles = "".join(export_cuda(t).SerializeToString().hex() + "\n" for t in src.values())
    mapped, _ = proc.communicate(handles, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the mapping process exited {proc.returncode}")
    out["ipc_mapped"] = json.loads(mapped.strip().splitlines()[-1])
    for part in ("own_memory", "ipc_mapped"):
        for way in [*out[part].values(), *out[part]["table_variants"]]:
            if isinstance(way, dict) and "GB/s" in way:
                way["ratio"] = round(way.pop("GB/s") / limit, 3)
    out["flat"]["ratio"] = round(out["flat"].pop("GB/s") / limit, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
