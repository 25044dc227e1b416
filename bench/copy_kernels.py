"""Which form of the table-driven copy kernel (rlsync.transfer.batched) moves a user's scattered
model at the device's copy rate: the same 399 tensors of a 4B model into one buffer, each form timed
against one flat copy of the same bytes in the same run (medians of --repeats after a warm-up).

    python bench/copy_kernels.py [--preset qwen3-4b] [--repeats 10]

Forms: "masked" (8-byte words, every step masked: the library's first form), "unmasked" (whole
steps unmasked, one masked tail), "pairs" (steps of [BLOCK, 2] words, each pair one 16-byte access:
what rlsync.transfer.batched_kernel keeps, the fastest on H200), each over chunk sizes, steps and
warps; then the fp32 -> bf16 cast kernel's forms ("masked": the library's; "unmasked": whole steps
unmasked, one masked tail) against torch's flat cast, likewise. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402
from transfer import make_tensors  # noqa: E402

from rlsync.transfer import batched  # noqa: E402
from rlsync.transfer.batched_kernel import cast_chunks, copy_chunks  # noqa: E402


@triton.jit
def masked(table, BLOCK: tl.constexpr):
    row = table + tl.program_id(0) * 3
    src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int64)), 16)
    dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int64)), 16)
    words = tl.multiple_of(tl.load(row + 2) // 8, 2)
    for start in range(0, words, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < words
        tl.store(dst + at, tl.load(src + at, mask=inside, eviction_policy="evict_first"), mask=inside)


@triton.jit
def unmasked(table, BLOCK: tl.constexpr):
    row = table + tl.program_id(0) * 3
    src = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(tl.int64))
    dst = tl.multiple_of(tl.load(row + 1), 16).to(tl.pointer_type(tl.int64))
    words = tl.load(row + 2) // 8
    whole = words // BLOCK * BLOCK
    for start in range(0, whole, BLOCK):
        at = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        tl.store(dst + at, tl.load(src + at))
    at = whole + tl.arange(0, BLOCK)
    inside = at < words
    tl.store(dst + at, tl.load(src + at, mask=inside), mask=inside)


FORMS = {"masked": masked, "unmasked": unmasked, "pairs": copy_chunks}  # pairs: the library's own kernel


@triton.jit
def cast_unmasked(table, BLOCK: tl.constexpr):
    """cast_chunks with whole steps unmasked and one masked tail, its loads marked to leave the cache first."""
    row = table + tl.program_id(0) * 3
    src = tl.multiple_of(tl.load(row), 16).to(tl.pointer_type(tl.uint32))
    dst = tl.multiple_of(tl.load(row + 1), 8).to(tl.pointer_type(tl.uint16))
    n = tl.multiple_of(tl.load(row + 2), 4)
    whole = n // BLOCK * BLOCK
    for start in range(0, whole, BLOCK):
        i = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        bits = tl.load(src + i, eviction_policy="evict_first")
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(dst + i, tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, rounded).to(tl.uint16))
    i = whole + tl.arange(0, BLOCK)
    inside = i < n
    bits = tl.load(src + i, mask=inside)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    tl.store(dst + i, tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, rounded).to(tl.uint16), mask=inside)


CAST_FORMS = {"masked": cast_chunks, "unmasked": cast_unmasked}  # masked: the library's own cast kernel


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def cast_forms(shapes, repeats: int) -> dict:
    """The same tensors in fp32, scattered, cast into one bf16 buffer: the library's cast kernel in one
    launch over a table, a copy_ each (torch's cast kernel per tensor), and one flat copy_ of all the
    elements (torch's cast at its best), each bit for bit against torch's own cast."""
    srcs = [torch.randn(math.prod(shape), device="cuda:0") for shape in shapes.values()]
    flat = torch.empty(sum(t.numel() for t in srcs), dtype=torch.bfloat16, device="cuda:0")
    dsts = list(torch.split(flat, [t.numel() for t in srcs]))
    rows, rest = batched.split(list(zip(srcs, dsts)), cast=True)
    table = batched.table(rows, torch.device("cuda:0"), cast=True)
    flat_src = torch.cat(srcs)
    out = {"elements": flat.numel(), "in_table": len(rows), "rest": len(rest),
           "flat_copy_ms": round(timed(lambda: flat.copy_(flat_src), repeats) * 1e3, 3)}
    for name, fn in (("table", lambda: batched.launch(table)),
                     ("copy_each", lambda: [d.copy_(s) for s, d in zip(srcs, dsts)])):
        flat.zero_()
        out[f"{name}_ms"] = round(timed(fn, repeats) * 1e3, 3)
        for a, b in rest:
            b.copy_(a)
        out[f"{name}_exact"] = all(torch.equal(d.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))
                                   for s, d in zip(srcs, dsts))
    out["table_vs_flat"] = round(out["flat_copy_ms"] / out["table_ms"], 3)
    out["copy_each_vs_flat"] = round(out["flat_copy_ms"] / out["copy_each_ms"], 3)
    out["forms"] = []  # the cast kernel's forms, chunk sizes (elements), steps and warps
    for (name, kernel), chunk, warps in itertools.product(CAST_FORMS.items(), (1 << 16, 1 << 18), (4, 8)):
        chunked = torch.from_numpy(batched.chunks(rows, chunk, (4, 2))).cuda()
        for block in (1024, 2048, 4096):
            flat.zero_()
            seconds = timed(lambda k=kernel, t=chunked, b=block, w=warps: k[(t.shape[0],)](t, BLOCK=b, num_warps=w),
                            repeats)
            for a, b in rest:
                b.copy_(a)
            exact = all(torch.equal(d.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))
                        for s, d in zip(srcs, dsts))
            out["forms"].append({"form": name, "chunk": chunk, "block": block, "warps": warps,
                                 "ms": round(seconds * 1e3, 3),
                                 "ratio": round(out["flat_copy_ms"] / (seconds * 1e3), 3), "exact": exact})
    out["best"] = max((f for f in out["forms"] if f["exact"]), key=lambda f: f["ratio"], default=None)
    return out


def launch_costs(rows, calls: int = 200) -> dict:
    """CPU microseconds per launch of the library's table (its rows cut to 16 bytes: the GPU's time
    is not what is measured), as batched.launch makes it, as a replay of a CUDA graph of it, and of
    one copy_ for scale."""
    tiny = rows.copy()
    tiny[:, 2] = 16
    table = batched.table(tiny, torch.device("cuda:0"))
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    batched.launch(table)  # compiled before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        batched.launch(table)
    a, b = torch.empty(16, dtype=torch.uint8, device="cuda:0"), torch.empty(16, dtype=torch.uint8, device="cuda:0")
    out = {}
    for name, fn in (("triton", lambda: batched.launch(table)), ("graph_replay", graph.replay),
                     ("copy_", lambda: b.copy_(a, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = round((time.perf_counter() - start) / calls * 1e6, 1)
        torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    shapes = preset_shapes(args.preset)
    srcs = [t.view(-1).view(torch.uint8) for t in make_tensors(shapes, "cuda:0", "scattered").values()]
    dsts = [t.view(-1).view(torch.uint8) for t in make_tensors(shapes, "cuda:0", "flat").values()]
    nbytes = sum(t.numel() for t in srcs)
    rows, rest = batched.split(list(zip(srcs, dsts)))
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    flat_dst = torch.empty_like(flat_src)
    flat = timed(lambda: flat_dst.copy_(flat_src), args.repeats)
    out = {"gpu": torch.cuda.get_device_name(0), "bytes": nbytes, "tensors": len(srcs), "in_table": len(rows),
           "flat_ms": round(flat * 1e3, 3), "forms": []}
    for (name, kernel), chunk, warps in itertools.product(FORMS.items(), (1 << 18, 1 << 20), (4, 8)):
        table = torch.from_numpy(batched.chunks(rows, chunk)).cuda()
        for block in (1024, 2048):
            for d in dsts:
                d.zero_()
            seconds = timed(lambda k=kernel, t=table, b=block, w=warps: k[(t.shape[0],)](t, BLOCK=b, num_warps=w),
                            args.repeats)
            for a, b in rest:  # what the table leaves out
                b.copy_(a)
            exact = all(torch.equal(a, b) for a, b in zip(srcs, dsts))
            out["forms"].append({"form": name, "chunk": chunk, "block": block, "warps": warps,
                                 "ms": round(seconds * 1e3, 3), "ratio": round(flat / seconds, 3), "exact": exact})
    out["best"] = max((f for f in out["forms"] if f["exact"]), key=lambda f: f["ratio"])
    out["launch_us"] = launch_costs(rows)
    del srcs, dsts
    out["cast"] = cast_forms(shapes, args.repeats)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
