"""GPU cycles through the coordinator, on a real-size model (random weights, built locally).

Colocated (one GPU): trainer and an hf replica share the GPU; each cycle generates, trains
(engine sleeps, trainer onloads), syncs (wake weights, CUDA IPC transfer, commit, trainer offloads,
wake KV cache). Disaggregated (2+ GPUs): trainer on GPU 0, replicas on the others, async mode,
generation running while the weights are broadcast. Under updates (any GPU count): generation
through the gateway with an update every --interval seconds, in the inflight mode (no pause) and
the async mode (abort and resume), against the same generation without updates. Prints one JSON
object.

    python bench/gpu_cycle.py --preset qwen3-1.7b --cycles 5
    python bench/gpu_cycle.py --only updates --mode inflight --interval 2
    python bench/gpu_cycle.py --only colocated --lora-rank 16   # the trainer syncs a LoRA adapter only
    python bench/gpu_cycle.py --engine vllm --only colocated      # vLLM replicas (its sleep mode, eager)
    python bench/gpu_cycle.py --trainer-nproc 2 --only colocated   # an FSDP2 trainer of 2 ranks: routed pulls
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_metrics import samples  # noqa: E402
from transfer import d2d_limit, nccl_limit  # noqa: E402

from rlsync.client import (AsyncCoordinatorClient, CoordinatorClient, RolloutClient, TrainerClient,  # noqa: E402
                           trajectory)
from rlsync.launch import ServiceProcess  # noqa: E402
from rlsync.models import build_preset  # noqa: E402
from rlsync.rollout.__main__ import parse_engine_arg  # noqa: E402
from rlsync.rollout.engines.vllm_trace import TRACE_ENV, read as read_trace  # noqa: E402

GIB = 1 << 30
ENGINE = "hf"  # the replicas' engine (--engine)
ENGINE_ARGS = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 128}  # the replicas' (--engine-arg adds)
# vLLM on one GPU beside the trainer: its sleep mode (the colocated switch), a fixed KV cache, eager (no
# compile or graph capture at start); gpu_memory_utilization only bounds what vLLM checks is free at start.
VLLM_ARGS = {"dtype": "bfloat16", "enable_sleep_mode": True, "enforce_eager": True, "gpu_memory_utilization": 0.3,
             "kv_cache_memory_bytes": 8 << 30, "max_num_seqs": 128}


def gpu_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / GIB, 2)


def start(logs: Path, mode: str, model: str, trainer_gpu: str, replica_gpus: list[str], trainer_args=(),
          coordinator_args=(), replica_env=None):
    co = ServiceProcess("coordinator", ["--port", "0", "--sync-mode", mode, *coordinator_args],
                        log_path=logs / "coordinator.log")
    address = co.wait_ready()
    engine = json.dumps(ENGINE_ARGS)
    fleet = [co, ServiceProcess("trainer", ["--port", "0", "--coordinator", address, "--model", model, "--device",
                                            "cuda", "--dtype", "bfloat16", "--lr", "1e-5", *trainer_args],
                                env={"CUDA_VISIBLE_DEVICES": trainer_gpu}, log_path=logs / "trainer.log")]
    fleet += [ServiceProcess("rollout", ["--port", "0", "--coordinator", address, "--engine", ENGINE, "--model", model,
                                         "--engine-args", engine, "--replica-id", f"r{i}", "--metrics-port", "0"],
                             env={"CUDA_VISIBLE_DEVICES": gpu, **(replica_env or {})}, log_path=logs / f"r{i}.log")
              for i, gpu in enumerate(replica_gpus)]
    for p in fleet[1:]:
        p.wait_ready(600)
    with CoordinatorClient(address) as c:
        c.wait_ready(len(fleet) - 1, timeout=600)
    return fleet


def peak_during(fn):
    """(fn(), the most GPU memory in use on the device, GiB, sampled every millisecond while fn ran)."""
    import threading

    peak, done = [gpu_used()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], gpu_used())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return fn(), peak[0]
    finally:
        done.set()
        sampler.join()


def memory(trainer: TrainerClient, replicas: list[RolloutClient]) -> dict:
    return {"trainer_gib": round(trainer.state().device_reserved_bytes / GIB, 2),
            "replicas_gib": [round(r.info().memory.device_reserved_bytes / GIB, 2) for r in replicas],
            "gpu_used_gib": gpu_used()}


def moving(phases) -> float:
    """The transfer phase: from the offer made to the bytes in place on every replica, i.e. the
    prepare (a replica on the trainer's GPU pulls the bytes in it; one on the trainer's host is rung
    by the trainer as soon as the offer exists) and the publish, if any."""
    return phases["prepare"] + phases["transfer"]


def transfer_figures(sync, limit: float, vs: str) -> dict:
    """GB/s of the whole transfer phase (as the coordinator saw it) and of the bytes' own move on
    the receiver, each against the limit, with the profile that says where the rest went."""
    profile = dict(sync.transfer_profile)
    # (A pull the trainer waits for on the GPU has no copy of its own on record: only "queue", the
    # replica's launch, and "copied", the trainer's wait after the answer.)
    moved = profile.get("receiver_copy") or profile.get("receiver_broadcast") or 0.0
    gbps = sync.bytes / moving(sync.phases) / 1e9
    figures = {"transfer_GB/s": round(gbps, 1), f"transfer_vs_{vs}": round(gbps / limit, 3)}
    if moved:
        data = sync.bytes / moved / 1e9
        figures |= {"copy_GB/s": round(data, 1), f"copy_vs_{vs}": round(data / limit, 3)}
    return figures | {"transfer_profile_ms": {k: round(v * 1e3, 3) for k, v in profile.items()}}


def steady(cycles: list[dict], vs: str) -> dict:
    """Medians over the cycles after the first (which pays one-time setup)."""
    rest = cycles[1:] or cycles
    keys = ["transfer_GB/s", f"transfer_vs_{vs}", "copy_GB/s", f"copy_vs_{vs}"]
    out = {k: round(statistics.median(c[k] for c in rest), 3) for k in keys if all(k in c for c in rest)}
    stages = {k for c in rest for k in c["transfer_profile_ms"]}
    out["transfer_profile_ms"] = {k: round(statistics.median(c["transfer_profile_ms"].get(k, 0.0) for c in rest), 3)
                                  for k in sorted(stages)}
    out["transfer_ms"] = round(statistics.median(moving(c["phases_s"]) * 1e3 for c in rest), 3)
    # making the offer precedes the transfer phase (a sharded trainer's ranks describe their memory in it)
    out["offer_ms"] = round(statistics.median(c["phases_s"]["offer"] * 1e3 for c in rest), 3)
    return out


async def generate(address: str, prompts: int, group: int, max_tokens: int):
    async with AsyncCoordinatorClient(address, timeout=None) as c:
        return await asyncio.gather(*(c.complete(f"prompt {i}", n=group, max_tokens=max_tokens, ignore_eos=True,
                                                 logprobs=True, seed=i) for i in range(prompts)))


def colocated(model: str, cycles: int, logs: Path, limit: float, trainer_args=(), coordinator_args=()) -> dict:
    fleet = start(logs, "colocated", model, "0", ["0"], trainer_args, coordinator_args)
    c, t, r = CoordinatorClient(fleet[0].address), TrainerClient(fleet[1].address), RolloutClient(fleet[2].address)
    out = []
    try:
        for cycle in range(cycles):
            t0 = time.perf_counter()
            groups = asyncio.run(generate(fleet[0].address, 8, 4, 32))
            gen = time.perf_counter() - t0
            m_generate = memory(t, [r])  # engine awake, trainer offloaded (after the first sync)
            batch = [trajectory(comp, reward=float(i % 2), group_id=str(g)) for g, comps in enumerate(groups)
                     for i, comp in enumerate(comps)]
            t1 = time.perf_counter()
            step = c.train(batch)
            m_train = memory(t, [r])  # engine asleep, trainer onloaded
            sync, peak = peak_during(lambda: c.sync_weights(verify=True))  # wake, update, offload, wake KV
            m_sync = memory(t, [r])
            m_sync["peak_gpu_used_during_sync_gib"] = peak
            phases = {"generate": gen, "sleep": step.metrics.get("sleep_seconds", 0.0),
                      "onload": step.metrics.get("onload_seconds", 0.0),
                      "train": time.perf_counter() - t1 - sync.seconds, **dict(sync.phases)}
            out.append({"cycle": cycle + 1, "version": sync.version, "verified": sync.verified,
                        "phases_s": {k: round(v, 4) for k, v in phases.items()},
                        **transfer_figures(sync, limit, "d2d"), "backends": dict(sync.backends), "bytes": sync.bytes,
                        "memory": {"generating": m_generate, "training": m_train, "after_sync": m_sync}})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        floor = rpc_floor(fleet[2].address)
    finally:
        for p in reversed(fleet):
            p.stop()
    return {"steady": steady(out, "d2d"), "rpc_floor_ms": floor, "cycles": out}


_HEALTH_SERVER = """
import asyncio, sys, grpc
from grpc_health.v1 import health, health_pb2_grpc
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def rpc_floor(replica: str, calls: int = 300) -> dict:
    """Median round trips (ms) from a grpc.aio client, as the coordinator's: a health check against
    a bare grpc.aio server in a fresh process (Python gRPC's floor on this host), the same against
    the replica's server, and the replica's GetInfo through rlsync's client."""
    import subprocess

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rlsync.client import AsyncRolloutClient

    bare = subprocess.Popen([sys.executable, "-c", _HEALTH_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = bare.stdout.readline().strip()

        async def median(call) -> float:
            for _ in range(20):
                await call()
            runs = []
            for _ in range(calls):
                start = time.perf_counter()
                await call()
                runs.append(time.perf_counter() - start)
            return round(statistics.median(runs) * 1e3, 3)

        async def run() -> dict:
            out = {}
            for name, address in (("bare_server_health", f"127.0.0.1:{port}"), ("replica_health", replica)):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    out[name] = await median(lambda stub=stub: stub.Check(health_pb2.HealthCheckRequest()))
            async with AsyncRolloutClient(replica) as client:
                out["replica_get_info"] = await median(client.info)
            return out

        return asyncio.run(run())
    finally:
        bare.kill()


def disaggregated(model: str, cycles: int, logs: Path, gpus: int, limit: float, streams: int = 32, trainer_args=(),
                  replica_env=None) -> dict:
    fleet = start(logs, "async", model, "0", [str(i) for i in range(1, gpus)], trainer_args, replica_env=replica_env)
    c = CoordinatorClient(fleet[0].address)
    out, counts = [], {"done": 0, "bad": 0}

    async def background(stop: asyncio.Event):
        async with AsyncCoordinatorClient(fleet[0].address, timeout=None) as gc:
            async def one(i):
                while not stop.is_set():
                    comp = (await gc.complete(f"bg {i}", max_tokens=64, ignore_eos=True))[0]
                    counts["done"] += 1
                    counts["bad"] += len(comp.token_ids) != 64

            await asyncio.gather(*(one(i) for i in range(streams)))

    async def run():
        stop = asyncio.Event()
        bg = asyncio.create_task(background(stop))
        loop = asyncio.get_running_loop()
        for cycle in range(cycles):
            groups = await generate(fleet[0].address, 8, 4, 32)
            batch = [trajectory(comp, reward=float(i % 2), group_id=str(g)) for g, comps in enumerate(groups)
                     for i, comp in enumerate(comps)]
            await loop.run_in_executor(None, c.train, batch)
            sync = await loop.run_in_executor(None, lambda: c.sync_weights(verify=True))
            out.append({"cycle": cycle + 1, "version": sync.version, "verified": sync.verified,
                        "pause_window_s": round(sync.seconds, 4),
                        "phases_s": {k: round(v, 4) for k, v in sync.phases.items()},
                        **transfer_figures(sync, limit, "nccl"), "backends": dict(sync.backends)})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
        stop.set()
        await bg

    try:
        asyncio.run(run())
        status = c.status()
    finally:
        for p in reversed(fleet):
            p.stop()
    return {"steady": steady(out, "nccl"), "cycles": out, "background_streams": counts["done"],
            "lost_or_short": counts["bad"], "aborted_and_resumed": status.resubmissions}


def under_updates(model: str, logs: Path, mode: str, limit: float, seconds: float, interval: float,
                  streams: int = 32, max_tokens: int = 256, trainer_args=(), replica_env=None,
                  rounds: int = 2, trace: bool = False) -> dict:
    """Generation through the gateway (`streams` streams, each starting a new request when one ends)
    for `seconds` without updates and for `seconds` with a sync every `interval` seconds: tokens/s
    of both windows, the gaps between two tokens of one stream (the longest across an update against
    the median without), and each sync's phases. One GPU: trainer and replica share it (cuda_ipc);
    more: the replica on GPU 1 (a pull over P2P; nccl with --no-peer). mode: inflight (no pause) or async
    (abort and resume). trace: each sync's longest gap also lists the replica's engine steps, output batches
    and commit stages that overlap it (vLLM: rollout.engines.vllm_trace)."""
    gpus = torch.cuda.device_count()
    steps = logs / "steps.jsonl"
    if trace:
        steps.unlink(missing_ok=True)
        replica_env = {**(replica_env or {}), TRACE_ENV: str(steps)}
    fleet = start(logs, mode, model, "0", ["1" if gpus > 1 else "0"], trainer_args, replica_env=replica_env)
    address = fleet[0].address
    arrivals: list[list[tuple[float, int, int]]] = [[] for _ in range(streams)]  # (time, tokens, request)

    async def stream(i: int, gc, stop: asyncio.Event) -> None:
        request = 0
        while not stop.is_set():
            request += 1
            length = random.Random(i * 1000 + request).randint(max_tokens // 2, max_tokens * 3 // 2)  # RL-like spread
            async for chunk in gc.generate(f"stream {i} {request}", max_tokens=length, ignore_eos=True, seed=i):
                if chunk.token_ids:
                    arrivals[i].append((time.perf_counter(), len(chunk.token_ids), request))

    async def run() -> tuple[list, list, list, list]:
        """Quiet and busy windows alternate (`rounds` times each, `seconds` in all for each kind), so
        that the batch's drift (contexts grow, streams restart) weighs on both alike."""
        async with AsyncCoordinatorClient(address, timeout=None) as gc:
            await gc.sync_weights(version=1)  # warm-up: first connections and mappings
            stop = asyncio.Event()
            tasks = [asyncio.create_task(stream(i, gc, stop)) for i in range(streams)]
            await asyncio.sleep(5)  # every stream running
            syncs, windows, quiet, busy, version = [], [], [], [], 1
            for _ in range(rounds):
                t0 = time.perf_counter()
                await asyncio.sleep(seconds / rounds)
                quiet.append((t0, time.perf_counter()))
                busy_start = time.perf_counter()
                while time.perf_counter() < busy_start + seconds / rounds:
                    version += 1
                    t0 = time.perf_counter()
                    syncs.append(await gc.sync_weights(version=version))
                    windows.append((t0, time.perf_counter()))
                    await asyncio.sleep(max(0.0, t0 + interval - time.perf_counter()))
                busy.append((busy_start, time.perf_counter()))
            stop.set()
            await asyncio.gather(*tasks)
            return syncs, windows, quiet, busy

    try:
        syncs, windows, quiet, busy = asyncio.run(run())
        status = CoordinatorClient(address).status()
        armed = armed_copies(fleet[2:])
    finally:
        for p in reversed(fleet):
            p.stop()

    def rate(windows: list[tuple[float, float]]) -> float:
        tokens = sum(n for a in arrivals for t, n, _ in a for w0, w1 in windows if w0 <= t < w1)
        return tokens / sum(w1 - w0 for w0, w1 in windows)

    # each busy window against the quiet one before it: the spread of these says how far the ratio of
    # the sums can be trusted (the batch's own drift: contexts grow, streams end and join)
    paired = [rate([b]) / rate([q]) for q, b in zip(quiet, busy)]

    def gaps(windows: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
        """(gap, from, to) between consecutive tokens of one request, inside the windows."""
        return [(b[0] - a[0], a[0], b[0]) for arr in arrivals for a, b in zip(arr, arr[1:])
                if a[2] == b[2] and any(w0 <= a[0] and b[0] < w1 for w0, w1 in windows)]

    events = sorted(read_trace(str(steps)), key=lambda e: e[1]) if trace and steps.exists() else []
    quiet_gaps = [g for g, _, _ in gaps(quiet)]
    median_gap = statistics.median(quiet_gaps)
    across = [g for g, t0, t1 in gaps(busy) if any(t0 < w1 and t1 > w0 for w0, w1 in windows)]
    busy_gaps = gaps(busy)

    def longest(w0: float, w1: float) -> dict:
        """The longest gap across the sync of window (w0, w1), its ends in ms from the sync's start: which
        phase it spans (phases_ms run offer, prepare, transfer, commit)."""
        g = max(((g, t0, t1) for g, t0, t1 in busy_gaps if t0 < w1 and t1 > w0), default=None)
        if g is None:
            return {}
        out = {"ms": round(g[0] * 1e3, 2), "from_ms": round((g[1] - w0) * 1e3, 2), "to_ms": round((g[2] - w0) * 1e3, 2)}
        if events:  # what the replica did from a step before the gap to its end: [kind, start, end] in ms
            out["replica"] = [[k, round((a - w0) * 1e3, 2), round((b - w0) * 1e3, 2)] for k, a, b in events
                              if b > g[1] - 2 * median_gap and a < g[2]]
        return {"longest_gap": out}

    per_sync = [{"version": s.version, "seconds": round(s.seconds, 4),
                 "phases_ms": {k: round(v * 1e3, 3) for k, v in s.phases.items()},
                 **transfer_figures(s, limit, "limit"), **longest(*w)} for s, w in zip(syncs, windows)]
    transfer_ms = statistics.median(moving(s.phases) * 1e3 for s in syncs)
    out = {"mode": mode, "streams": streams, "syncs": len(syncs), "interval_s": interval, "window_s": seconds,
           "rounds": rounds,
           "tokens_per_s_without_updates": round(rate(quiet), 1), "tokens_per_s_with_updates": round(rate(busy), 1),
           "throughput_ratio": round(rate(busy) / rate(quiet), 3),
           "throughput_ratio_by_round": [round(r, 3) for r in paired],
           "median_token_gap_ms": round(median_gap * 1e3, 2),
           "longest_gap_across_an_update_ms": round(max(across, default=0.0) * 1e3, 2),
           "longest_gap_vs_median": round(max(across, default=0.0) / median_gap, 2),
           # the engine's own spread, no update near: a step that admits new requests also prefills them
           "longest_gap_without_updates_vs_median": round(max(quiet_gaps) / median_gap, 2),
           # the same against the gaps around each update (the batch drifts: a round whose steps all run slower
           # raises every gap in it, an update's or not)
           "longest_gap_vs_local_median": gap_vs_local_median(busy_gaps, windows),
           "transfer_ms": round(transfer_ms, 3),
           # the offer: with a publish buffer, the trainer's copy of its weights into it is here
           "offer_ms": round(statistics.median(s.phases["offer"] * 1e3 for s in syncs), 3),
           "transfer_vs_limit": round(statistics.median(p["transfer_vs_limit"] for p in per_sync), 3),
           # how each sync's copy began on the replica: adopted (armed beforehand and started by the trainer's bell:
           # the hf engine's arm_while_generating), launched as its prepare began, or neither (a receiver laid out)
           "copies": copies_by_start(per_sync),
           # what became of the copies the replicas armed beside generation (hf arm_while_generating): adopted,
           # late (the trainer's bell had not reached one when its offer came), let_go, stopped
           **({"armed_copies": armed} if armed else {}),
           "aborted_and_resumed": status.resubmissions, "per_sync": per_sync}
    if events:
        out["update_trace"] = update_trace(events)
    if mode == "async":  # the pause window: everything between the abort and the resume
        windows_ms = [sum(s.phases.get(k, 0.0) for k in ("pause", "commit", "resume")) * 1e3 for s in syncs]
        out["pause_window_ms"] = round(statistics.median(windows_ms), 3)
        out["pause_window_max_ms"] = round(max(windows_ms), 3)
        out["pause_window_minus_transfer_ms"] = round(statistics.median(windows_ms) - transfer_ms, 3)
    return out


def armed_copies(replicas: list[ServiceProcess]) -> dict[str, int]:
    """rlsync_replica_armed_copies_total by outcome, summed over the replicas' /metrics ({}: none armed)."""
    out: dict[str, int] = {}
    for p in replicas:
        for s in samples(p.http_address("metrics")):
            if s.name == "rlsync_replica_armed_copies_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + int(s.value)
    return out


def copies_by_start(per_sync: list[dict]) -> dict[str, int]:
    """How many syncs' copies were adopted, launched, or neither, by the replica's stages in their profiles (of
    one replica: the first that names either)."""
    out = {"adopted": 0, "launched": 0, "other": 0}
    for sync in per_sync:
        stages = sync.get("transfer_profile_ms", {})
        out["adopted" if "receiver_adopt" in stages else "launched" if "receiver_launch" in stages else "other"] += 1
    return out


def gap_vs_local_median(gaps: list[tuple[float, float, float]], windows: list[tuple[float, float]],
                        around: float = 0.5) -> float | None:
    """The largest, over the updates (windows: each sync's start and end), of the longest token gap (gap, from, to)
    across the update against the median of the gaps that start within `around` s of it and cross no update."""
    def crosses(t0: float, t1: float, w: tuple[float, float]) -> bool:
        return t0 < w[1] and t1 > w[0]

    clear = [(g, t0) for g, t0, t1 in gaps if not any(crosses(t0, t1, v) for v in windows)]  # (found once)
    ratios = []
    for w in windows:
        across = [g for g, t0, t1 in gaps if crosses(t0, t1, w)]
        near = [g for g, t0 in clear if abs(t0 - w[0]) <= around]
        if across and near:
            ratios.append(max(across) / statistics.median(near))
    return round(max(ratios), 2) if ratios else None


def update_trace(events: list[tuple[str, float, float]]) -> dict:
    """Where an update's gaps go, from a vLLM replica's trace (medians, ms): an engine step (execute_model) alone and
    the first after each commit; from the end of one step to the start of the next with no call of the update's
    between them, and across each such call (worker_begin: the prepare's receive; worker_commit: the commit), with
    the call's own time. Both calls run on the engine's thread, between two steps."""
    steps = [(a, b) for k, a, b in events if k == "execute_model"]
    between = [(s0[1], s1[0]) for s0, s1 in zip(steps, steps[1:])]
    calls = {kind: [(a, b) for k, a, b in events if k == kind] for kind in ("worker_begin", "worker_commit")}

    def median_ms(values: list[float]) -> float | None:
        return round(statistics.median(values) * 1e3, 3) if values else None

    def across(spans: list[tuple[float, float]]) -> list[bool]:
        return [any(e0 <= c0 and c1 <= s1 for c0, c1 in spans) for e0, s1 in between]

    alone = across([c for spans in calls.values() for c in spans])
    after = [min((s for s in steps if s[0] >= c1), default=None) for _, c1 in calls["worker_commit"]]
    out = {"step_ms": median_ms([b - a for a, b in steps]),
           "first_step_after_commit_ms": median_ms([b - a for a, b in filter(None, after)]),
           "between_steps_ms": median_ms([s1 - e0 for (e0, s1), c in zip(between, alone) if not c])}
    for kind, spans in calls.items():
        crossing = [s1 - e0 for (e0, s1), c in zip(between, across(spans)) if c]
        out[kind] = {"calls": len(spans), "ms": median_ms([b - a for a, b in spans]),
                     "between_steps_across_ms": median_ms(crossing)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--only", choices=("colocated", "disaggregated", "updates"), default=None)
    parser.add_argument("--mode", choices=("inflight", "async"), action="append",
                        help="generation under updates in this sync mode (repeatable; default both)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="seconds of quiet and of busy windows each, in the run under updates")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between two updates")
    parser.add_argument("--rounds", type=int, default=2,
                        help="how many times the quiet and busy windows alternate in the run under updates")
    parser.add_argument("--streams", type=int, default=32,
                        help="disaggregated only: generation streams running through every update")
    parser.add_argument("--dir", default="/tmp/rlsync-gpu")
    parser.add_argument("--trace", action="store_true",
                        help="updates: each sync's longest gap lists what the (vLLM) replica did meanwhile")
    parser.add_argument("--no-doorbell", action="store_true",
                        help="colocated only: the coordinator prepares the replica by gRPC (the trainer rings none)")
    parser.add_argument("--no-hold", action="store_true",
                        help="colocated only: the replica maps the trainer's weights at each update, not at its onload")
    parser.add_argument("--publish-buffer", action="store_true",
                        help="updates and disaggregated: the trainer offers a copy of its weights, pulled while it "
                             "trains on")
    parser.add_argument("--no-peer", action="store_true",
                        help="replicas on other GPUs map nothing over P2P (RLSYNC_PEER_PULLS=0): NCCL broadcasts")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="colocated only: the trainer trains a LoRA adapter of this rank and syncs only it")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the replicas' engine")
    parser.add_argument("--trainer-nproc", type=int, default=1,
                        help="the trainer's ranks (FSDP2; on one GPU they share it: each rank's shards are pulled "
                             "by the replica, routed)")
    parser.add_argument("-E", "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="one more engine argument of every replica (repeatable)")
    args = parser.parse_args()
    global ENGINE
    ENGINE = args.engine
    if ENGINE == "vllm":
        ENGINE_ARGS.clear()
        ENGINE_ARGS.update(VLLM_ARGS)
    ENGINE_ARGS.update(parse_engine_arg(item) for item in args.engine_arg)
    root = Path(args.dir)
    model = str(build_preset(root / args.preset, args.preset, device="cuda"))
    nbytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    gpus = torch.cuda.device_count()
    ranks = ["--nproc", str(args.trainer_nproc)] * (args.trainer_nproc > 1)  # every cycle's trainer
    lora = ["--lora-rank", str(args.lora_rank), "--lora-alpha", str(2 * args.lora_rank)] if args.lora_rank else []
    result = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "engine": ENGINE, "preset": args.preset,
              "checkpoint_bytes": nbytes,
              "lora_rank": args.lora_rank, "trainer_nproc": args.trainer_nproc, "doorbell": not args.no_doorbell,
              "hold": not args.no_hold,
              "publish_buffer": args.publish_buffer, "peer_pulls": not args.no_peer, "engine_args": ENGINE_ARGS,
              "limits": {"d2d_copy_GB/s": round(d2d_limit(4 << 30, "cuda:0"), 1)}}
    replica_env = {"RLSYNC_PEER_PULLS": "0"} if args.no_peer else None
    torch.cuda.empty_cache()
    if args.only in (None, "colocated"):
        flags = ["--no-doorbell"] * args.no_doorbell + ["--no-hold-weights"] * args.no_hold
        result["colocated"] = colocated(model, args.cycles, root / "logs-colocated", result["limits"]["d2d_copy_GB/s"],
                                        lora + ranks, flags)
    if args.only in (None, "disaggregated") and gpus >= 2:
        result["limits"]["nccl_broadcast_GB/s"] = round(nccl_limit(nbytes, 2), 1)
        result["disaggregated"] = disaggregated(model, args.cycles, root / "logs-disaggregated", gpus,
                                                result["limits"]["nccl_broadcast_GB/s"], args.streams,
                                                ["--publish-buffer"] * args.publish_buffer + ranks, replica_env)
        result["disaggregated"]["streams"] = args.streams
    if args.only in (None, "updates"):
        limit = result["limits"].get("nccl_broadcast_GB/s") if gpus > 1 else result["limits"]["d2d_copy_GB/s"]
        if limit is None:
            limit = result["limits"]["nccl_broadcast_GB/s"] = round(nccl_limit(nbytes, 2), 1)
        buffer = ["--publish-buffer"] * args.publish_buffer + ranks
        for mode in args.mode or ["inflight", "async"]:
            result[f"updates_{mode}"] = under_updates(model, root / f"logs-{mode}", mode, limit, args.seconds,
                                                      args.interval, trainer_args=buffer, replica_env=replica_env,
                                                      rounds=args.rounds, trace=args.trace)
            print(json.dumps({k: v for k, v in result[f"updates_{mode}"].items() if k != "per_sync"}),
                  file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
