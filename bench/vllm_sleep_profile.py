"""Where vLLM's own sleep (level 1: weights to pinned host) and wake_up go, in one process: cProfile of
each call, the sleep pool's allocations by size, and gc.collect's share. Prints one JSON object.

    python bench/vllm_sleep_profile.py --preset qwen3-1.7b --cycles 3
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: one profile

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cycle import VLLM_ARGS  # noqa: E402

from rlsync.models import build_preset  # noqa: E402


def ms(fn) -> float:
    """Milliseconds `fn` takes, the GPU's work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) * 1e3, 2)


def top(profile: cProfile.Profile, n: int = 12) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(n)
    return [line for line in out.getvalue().splitlines() if "/" in line or "{" in line][:n]


def _storages(worker) -> list[torch.Tensor]:
    """Each distinct storage of the model's parameters and buffers, as a flat uint8 tensor."""
    seen, flats = set(), []
    for t in [*worker.model_runner.model.parameters(), *worker.model_runner.model.buffers()]:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            flats.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
    return flats


def _offload(worker) -> int:
    flats = _storages(worker)
    pool = getattr(worker, "_pool", None)
    if pool is None:
        pool = worker._pool = torch.empty(sum(f.numel() for f in flats), dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        at = 0
        for f in flats:
            pool[at:at + f.numel()].copy_(f, non_blocking=True)
            at += f.numel()
    stream.synchronize()
    return at


def _restore(worker) -> int:
    flats, pool, at = _storages(worker), worker._pool, 0
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in flats:
            f.copy_(pool[at:at + f.numel()], non_blocking=True)
            at += f.numel()
    stream.synchronize()
    return at


def _digest(worker) -> float:
    return float(sum(f.to(torch.float64).sum().item() * (i + 1) for i, f in enumerate(
        t.view(torch.uint8)[:1 << 20] for t in worker.model_runner.model.parameters())))


def pool_candidate(llm, cycles: int) -> dict:
    """Level 2 (nothing copied by vLLM) with the weights copied by the worker into one pinned pool kept
    across sleeps, and back after wake_up(weights), then once more into the same pages (a copy into pages
    mapped a copy before, against one into pages just mapped): each part timed, the weights checked after."""
    before = llm.collective_rpc(_digest)[0]
    parts: dict[str, list[float]] = {"copy_out": [], "sleep2": [], "wake_map": [], "copy_in": [], "copy_in_again": [],
                                     "wake_kv": []}
    for _ in range(cycles):
        for name, fn in (("copy_out", lambda: llm.collective_rpc(_offload)), ("sleep2", lambda: llm.sleep(level=2)),
                         ("wake_map", lambda: llm.wake_up(tags=["weights"])),
                         ("copy_in", lambda: llm.collective_rpc(_restore)),
                         ("copy_in_again", lambda: llm.collective_rpc(_restore)),  # the same pages, mapped before
                         ("wake_kv", lambda: llm.wake_up(tags=["kv_cache"]))):
            parts[name].append(ms(fn))
    return {"ms": parts, "weights_equal": llm.collective_rpc(_digest)[0] == before,
            "pool_bytes": llm.collective_rpc(lambda w: w._pool.numel())[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    from vllm import LLM
    from vllm.device_allocator.cumem import CuMemAllocator

    root = Path(tempfile.mkdtemp())
    model = str(build_preset(root / args.preset, args.preset, device="cuda"))
    llm = LLM(model=model, **VLLM_ARGS)
    allocator = CuMemAllocator.get_instance()
    sizes = sorted((d.handle[1] for d in allocator.pointer_to_data.values() if d.tag == "weights"), reverse=True)
    result = {"weights_allocations": len(sizes), "weights_bytes": sum(sizes), "largest": sizes[:5],
              "under_64MiB": sum(1 for s in sizes if s < 64 << 20)}
    result["gc_collect_ms"], result["empty_cache_ms"] = ms(gc.collect), ms(torch.cuda.empty_cache)
    times: dict[str, list[float]] = {"sleep": [], "wake_weights": [], "wake_kv_cache": []}
    profiles: dict[str, list[str]] = {}
    for cycle in range(args.cycles):
        for name, fn in (("sleep", lambda: llm.sleep(level=1)),
                         ("wake_weights", lambda: llm.wake_up(tags=["weights"])),
                         ("wake_kv_cache", lambda: llm.wake_up(tags=["kv_cache"]))):
            torch.cuda.synchronize()
            profile = cProfile.Profile() if cycle == args.cycles - 1 else None
            t = time.perf_counter()
            if profile:
                profile.enable()
            fn()
            torch.cuda.synchronize()
            if profile:
                profile.disable()
                profiles[name] = top(profile)
            times[name].append(time.perf_counter() - t)
    result["ms"] = {k: [round(v * 1e3, 1) for v in vs] for k, vs in times.items()}
    result["median_ms"] = {k: round(statistics.median(vs) * 1e3, 1) for k, vs in times.items()}
    gc.freeze()
    frozen = []
    for _ in range(2):
        frozen.append(ms(lambda: llm.sleep(level=1)))
        llm.wake_up()
    result["sleep_gc_frozen_ms"] = frozen
    result["pool"] = pool_candidate(llm, args.cycles)
    result["profiles"] = profiles
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
