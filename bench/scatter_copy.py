"""What copying a user's model tensor by tensor costs on one GPU, against one copy of the same bytes:
the part of a scattered pull left once its storages stay mapped (rlsync.transfer.held). One process,
no transfer library around it: the copy launches alone.

    python bench/scatter_copy.py [--preset qwen3-4b] [--repeats 5]

Ways: "flat" (one copy of every byte: the limit), "per_tensor" (a copy_ per tensor, as a pull writes a
scattered source into its destination), "foreach" (torch._foreach_copy_ over every tensor: one launch
per group of tensors), "hybrid" (foreach for tensors under 1 MiB, a copy_ each for the rest). Each is
timed from the first launch to the device's synchronize, medians of `--repeats` after a warm-up; the
launch time (CPU) is reported beside it. Prints one JSON object.
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
from models import preset_shapes  # noqa: E402
from transfer import d2d_limit, make_tensors  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = preset_shapes(args.preset)
    src = make_tensors(shapes, "cuda:0", "scattered")
    dst = make_tensors(shapes, "cuda:0", "flat")
    srcs = [t.view(-1).view(torch.uint8) for t in src.values()]
    dsts = [t.view(-1).view(torch.uint8) for t in dst.values()]
    nbytes = sum(t.numel() for t in srcs)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    flat_dst = torch.empty_like(flat_src)
    small = [i for i, t in enumerate(srcs) if t.numel() < SMALL]
    large = [i for i, t in enumerate(srcs) if t.numel() >= SMALL]

    def per_tensor():
        for s, d in zip(srcs, dsts):
            d.copy_(s, non_blocking=True)

    def hybrid():
        torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small], non_blocking=True)
        for i in large:
            dsts[i].copy_(srcs[i], non_blocking=True)

    ways = {"flat": lambda: flat_dst.copy_(flat_src, non_blocking=True), "per_tensor": per_tensor,
            "foreach": lambda: torch._foreach_copy_(dsts, srcs, non_blocking=True), "hybrid": hybrid}
    limit = d2d_limit(4 << 30, "cuda:0")
    out = {"gpu": torch.cuda.get_device_name(0), "preset": args.preset, "bytes": nbytes, "tensors": len(srcs),
           "small_tensors": len(small), "d2d_copy_GB_s": round(limit, 1), "ways": {}}
    for name, fn in ways.items():
        seconds, launch = timed(fn, args.repeats)
        out["ways"][name] = {"ms": round(seconds * 1e3, 3), "launch_ms": round(launch * 1e3, 3),
                             "ratio": round(nbytes / seconds / GB / limit, 3)}
    same = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
    out["copied_exactly"] = same
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
