"""Soak: many sync cycles, each under live streams through the gateway, while every process of the
fleet is sampled (RSS, open fds, threads, shared-memory descriptors, and /dev/shm segments).
Prints one JSON object: per process, the first and last sample and the growth per 100 cycles (the
least-squares slope over the samples after a warm-up), plus the streams' outcome.

    python bench/soak.py --cycles 500                  # hf engine
    python bench/soak.py --cycles 100 --engine vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import psutil

from rlsync.client import AsyncCoordinatorClient, CoordinatorClient, trajectory
from rlsync.launch import ServiceProcess

VLLM_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 32}


def sample(proc: psutil.Process) -> dict:
    """One process and its children (vLLM's engine processes), summed."""
    out = {"rss_mb": 0.0, "fds": 0, "threads": 0, "memfds": 0}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            out["rss_mb"] += p.memory_info().rss / 2**20
            out["fds"] += p.num_fds()
            out["threads"] += p.num_threads()
            out["memfds"] += sum(1 for f in os.listdir(f"/proc/{p.pid}/fd")
                                 if "memfd:" in _link(f"/proc/{p.pid}/fd/{f}"))
        except (psutil.NoSuchProcess, FileNotFoundError, PermissionError):
            continue
    out["rss_mb"] = round(out["rss_mb"], 1)
    return out


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


async def cycles(coordinator: str, count: int, streams: int, max_tokens: int, train_every: int,
                 on_sample, sample_every: int) -> dict:
    """Each cycle: `streams` generations through the gateway, a sync while they run (every
    `train_every` cycles a training step first), then every stream read to its end."""
    done = lost = 0
    sync_seconds = []
    async with AsyncCoordinatorClient(coordinator, timeout=None) as c:
        for cycle in range(count):
            tasks = [asyncio.create_task(c.complete(f"soak {cycle} {i}", max_tokens=max_tokens, ignore_eos=True,
                                                    seed=i)) for i in range(streams)]
            if train_every and cycle % train_every == 0:
                batch = await c.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=cycle)
                await c.train([trajectory(b, reward=float(i), group_id="g") for i, b in enumerate(batch)])
            s = await c.sync_weights()
            sync_seconds.append(s.seconds)
            for t in await asyncio.gather(*tasks, return_exceptions=True):
                ok = not isinstance(t, BaseException) and t[0].finish_reason == "length" and \
                    len(t[0].token_ids) == max_tokens
                done += ok
                lost += not ok
            if (cycle + 1) % sample_every == 0:
                on_sample(cycle + 1)
    sync_seconds.sort()
    return {"streams_completed": done, "streams_lost": lost,
            "sync_seconds_p50": round(sync_seconds[len(sync_seconds) // 2], 4),
            "sync_seconds_max": round(sync_seconds[-1], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--sync-mode", choices=("async", "inflight"), default="async")
    parser.add_argument("--streams", type=int, default=4, help="live streams per cycle")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--train-every", type=int, default=10, help="a training step every N cycles (0: never)")
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of cycles left out of the slopes")
    parser.add_argument("--logs", default="runs/soak")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    engine_args = json.dumps(VLLM_ARGS if args.engine == "vllm" else {})
    fleet = {"coordinator": ServiceProcess("coordinator", ["--port", "0", "--sync-mode", args.sync_mode],
                                           log_path=logs / "coordinator.log")}
    co = fleet["coordinator"].wait_ready()
    fleet["trainer"] = ServiceProcess("trainer", ["--port", "0", "--coordinator", co], log_path=logs / "trainer.log")
    for i in range(args.replicas):
        fleet[f"r{i}"] = ServiceProcess("rollout", ["--port", "0", "--coordinator", co, "--engine", args.engine,
                                                    "--engine-args", engine_args, "--replica-id", f"r{i}"],
                                        log_path=logs / f"r{i}.log")
    samples: dict[str, list[tuple[int, dict]]] = {name: [] for name in fleet}
    shm: list[tuple[int, int]] = []
    try:
        for p in fleet.values():
            p.wait_ready(300)
        with CoordinatorClient(co) as c:
            c.wait_ready(args.replicas + 1, timeout=300)
        procs = {name: psutil.Process(p.proc.pid) for name, p in fleet.items()}

        def on_sample(cycle: int) -> None:
            for name, proc in procs.items():
                samples[name].append((cycle, sample(proc)))
            shm.append((cycle, len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0))

        on_sample(0)
        start = time.perf_counter()
        outcome = asyncio.run(cycles(co, args.cycles, args.streams, args.max_tokens, args.train_every,
                                     on_sample, args.sample_every))
        seconds = time.perf_counter() - start
    finally:
        for p in reversed(list(fleet.values())):
            p.stop()
    skip = args.warmup * args.cycles

    def growth(points: list[tuple[int, float]]) -> float:
        kept = [(x, y) for x, y in points if x >= skip] or points
        return round(100 * slope([x for x, _ in kept], [y for _, y in kept]), 3)

    per_process = {}
    for name, points in samples.items():
        first, last = points[0][1], points[-1][1]
        per_process[name] = {"first": first, "last": last,
                             "growth_per_100_cycles": {k: growth([(x, s[k]) for x, s in points]) for k in first}}
    result = {"engine": args.engine, "sync_mode": args.sync_mode, "replicas": args.replicas, "cycles": args.cycles,
              "streams_per_cycle": args.streams, "train_every": args.train_every, "seconds": round(seconds, 1),
              **outcome, "processes": per_process,
              "dev_shm_segments": {"first": shm[0][1], "last": shm[-1][1],
                                   "growth_per_100_cycles": growth([(x, float(n)) for x, n in shm])}}
    print(json.dumps(result, indent=1))
    sys.exit(0 if outcome["streams_lost"] == 0 else 1)


if __name__ == "__main__":
    main()
