"""Gateway under load: N concurrent streams with weight updates mid-flight (correctness: nothing
lost, nothing duplicated, every token tagged), and the gateway's latency overhead against calling
a replica directly. Prints one JSON object.

    python bench/gateway_load.py --streams 200 --updates 3
    python bench/gateway_load.py --sync-mode inflight     # updates without a pause: nothing resubmitted
    python bench/gateway_load.py --burn 8 --no-latency    # while 8 busy loops starve the CPU (4x on 2 cores)

"liveness" has the coordinator's figures (bench/fleet_metrics.py): members suspected, cleared and dropped,
resubmissions by reason; "lease_drops" counts members dropped for a lease without progress: with no fault
injected, every one of them was a healthy member.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from rlsync.client import AsyncCoordinatorClient, AsyncRolloutClient, CoordinatorClient
from rlsync.launch import ServiceProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from burn import burning  # noqa: E402
from fleet_metrics import lease_drops, liveness  # noqa: E402

VLLM_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 256}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def timed(stream) -> tuple[float, float, list]:
    """(time to first token, total time, chunks) of one stream."""
    start, first, chunks = time.perf_counter(), None, []
    async for c in stream:
        if first is None and c.token_ids:
            first = time.perf_counter() - start
        chunks.append(c)
    return first or 0.0, time.perf_counter() - start, chunks


async def overhead(coordinator: str, replicas: list[str], streams: int, max_tokens: int) -> dict:
    """The same requests, no updates, sent directly (spread evenly over the replicas, as the
    gateway would) and through the gateway: per-request latency percentiles and their difference.
    Once one at a time (the hop's own cost), once all at once (cost under load)."""
    directs = [AsyncRolloutClient(a, timeout=None) for a in replicas]
    gateway = AsyncCoordinatorClient(coordinator, timeout=None)
    out: dict = {}
    try:
        for c in (*directs, gateway):
            await c.complete("warm up", max_tokens=2)
        for load, concurrency in (("sequential", 1), ("concurrent", streams)):
            for name in ("direct", "gateway"):
                def client(i, name=name):
                    return gateway if name == "gateway" else directs[i % len(directs)]

                runs = []
                n = 50 if concurrency == 1 else streams
                for start in range(0, n, concurrency):
                    runs += await asyncio.gather(*(timed(client(i).generate(
                        f"prompt {i}", max_tokens=max_tokens, ignore_eos=True, seed=i))
                        for i in range(start, min(n, start + concurrency))))
                out.setdefault(load, {})[name] = {
                    "ttft_p50": pct([r[0] for r in runs], 0.5), "ttft_p99": pct([r[0] for r in runs], 0.99),
                    "total_p50": pct([r[1] for r in runs], 0.5), "total_p99": pct([r[1] for r in runs], 0.99)}
            d, g = out[load]["direct"], out[load]["gateway"]
            out[load]["overhead_ms"] = {k: round((g[k] - d[k]) * 1000, 2) for k in d}
    finally:
        for c in (*directs, gateway):
            await c.close()
    return out


async def under_updates(coordinator: str, streams: int, max_tokens: int, updates: int) -> dict:
    """Syncs `updates` new versions (explicit version numbers, no training step in between: a step
    competes with the streams for the CPU and could let them finish first) while every stream runs."""
    async with AsyncCoordinatorClient(coordinator, timeout=None) as c:
        tasks = [asyncio.create_task(timed(c.generate(f"stream {i}", request_id=f"load-{i}", max_tokens=max_tokens,
                                                      ignore_eos=True, seed=i))) for i in range(streams)]
        syncs = []
        await asyncio.sleep(0.5)
        for u in range(updates):
            open_at_start = sum(not t.done() for t in tasks)  # > 0: the update lands mid-flight
            s = await c.sync_weights(version=u + 1)
            syncs.append({"version": s.version, "seconds": s.seconds, "phases": dict(s.phases),
                          "streams_open": open_at_start})
            await asyncio.sleep(0.3)  # let each version serve: the next sync's pause would otherwise meet
            # streams still being resubmitted, and a version could make no token at all
        runs = await asyncio.gather(*tasks)
        status = await c.status()
    problems, resubmitted, versions_seen, spanning = [], 0, set(), 0
    for i, (_, _, chunks) in enumerate(runs):
        finals = [ch for ch in chunks if ch.finish_reason]
        tokens = [t for ch in chunks for t in ch.token_ids]
        if len(finals) != 1:
            problems.append(f"stream {i}: {len(finals)} final chunks")
        elif finals[0].finish_reason != 2 or len(tokens) != max_tokens:
            problems.append(f"stream {i}: {len(tokens)} tokens, finish {finals[0].finish_reason}")
        if any(ch.request_id != f"load-{i}" for ch in chunks):
            problems.append(f"stream {i}: chunks of another request")
        tagged = [ch.weight_version for ch in chunks if ch.token_ids]
        if tagged != sorted(tagged):
            problems.append(f"stream {i}: versions go backwards {tagged}")
        versions_seen |= set(tagged)
        spanning += len(set(tagged)) > 1
        resubmitted += finals[0].resubmissions if finals else 0
        span_total = sum(s.length for s in finals[0].version_spans) if finals else 0
        if span_total != len(tokens):
            problems.append(f"stream {i}: version spans cover {span_total} of {len(tokens)} tokens")
    return {"streams": streams, "max_tokens": max_tokens, "updates": syncs, "lost_or_wrong": len(problems),
            "problems": problems[:10], "resubmissions": resubmitted, "versions_seen": sorted(versions_seen),
            "spanning_streams": spanning,
            "gateway_resubmissions_total": status.resubmissions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--sync-mode", choices=("async", "inflight"), default="async")
    parser.add_argument("--logs", default="runs/gateway_load")
    parser.add_argument("--no-latency", action="store_true", help="only the correctness run under updates")
    parser.add_argument("--burn", type=int, default=0, help="busy-loop processes starving the CPU while the "
                        "streams run (started once the fleet is up, stopped after)")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    engine_args = json.dumps(VLLM_ARGS if args.engine == "vllm" else {"max_num_seqs": 256})
    fleet = [ServiceProcess("coordinator", ["--port", "0", "--sync-mode", args.sync_mode, "--metrics-port", "0"],
                            log_path=logs / "coordinator.log")]
    co = fleet[0].wait_ready()
    fleet.append(ServiceProcess("trainer", ["--port", "0", "--coordinator", co], log_path=logs / "trainer.log"))
    fleet += [ServiceProcess("rollout", ["--port", "0", "--coordinator", co, "--engine", args.engine, "--engine-args",
                                         engine_args, "--replica-id", f"r{i}"], log_path=logs / f"r{i}.log")
              for i in range(args.replicas)]
    try:
        for p in fleet[1:]:
            p.wait_ready(300)
        with CoordinatorClient(co) as c:
            c.wait_ready(args.replicas + 1, timeout=300)
        result = {"engine": args.engine, "replicas": args.replicas, "sync_mode": args.sync_mode,
                  "burn": args.burn, "cores": os.cpu_count()}
        with burning(args.burn) if args.burn else contextlib.nullcontext():
            started = time.monotonic()
            result["load"] = asyncio.run(under_updates(co, args.streams, args.max_tokens, args.updates))
            result["load"]["seconds"] = round(time.monotonic() - started, 1)
            if not args.no_latency:
                result["latency"] = asyncio.run(overhead(co, [p.address for p in fleet[2:]], args.streams,
                                                         args.max_tokens))
            result["loadavg_1m"] = os.getloadavg()[0]
        result["liveness"] = liveness(fleet[0].http_address("metrics"))
        result["lease_drops"] = lease_drops(result["liveness"])
        with CoordinatorClient(co) as c:
            result["members_at_end"] = sorted(m.name for m in c.status().members)
    finally:
        for p in reversed(fleet):
            p.stop()
    print(json.dumps(result, indent=1))
    sys.exit(0 if result["load"]["lost_or_wrong"] == 0 else 1)


if __name__ == "__main__":
    main()
