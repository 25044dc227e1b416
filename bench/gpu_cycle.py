"""GPU cycles through the coordinator, on a real-size model (random weights, built locally).

Colocated (one GPU): trainer and an hf replica share the GPU; each cycle generates, trains
(engine sleeps, trainer onloads), syncs (wake weights, CUDA IPC transfer, commit, trainer offloads,
wake KV cache). Disaggregated (2+ GPUs): trainer on GPU 0, replicas on the others, async mode,
generation running while the weights are broadcast. Prints one JSON object.

    python bench/gpu_cycle.py --preset qwen3-1.7b --cycles 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import d2d_limit, nccl_limit  # noqa: E402

from rlsync.client import (AsyncCoordinatorClient, CoordinatorClient, RolloutClient, TrainerClient,  # noqa: E402
                           trajectory)
from rlsync.launch import ServiceProcess  # noqa: E402
from rlsync.models import build_preset  # noqa: E402

GIB = 1 << 30


def gpu_used() -> float:
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / GIB, 2)


def start(logs: Path, mode: str, model: str, trainer_gpu: str, replica_gpus: list[str]):
    co = ServiceProcess("coordinator", ["--port", "0", "--sync-mode", mode], log_path=logs / "coordinator.log")
    address = co.wait_ready()
    engine = json.dumps({"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 128})
    fleet = [co, ServiceProcess("trainer", ["--port", "0", "--coordinator", address, "--model", model, "--device",
                                            "cuda", "--dtype", "bfloat16", "--lr", "1e-5"],
                                env={"CUDA_VISIBLE_DEVICES": trainer_gpu}, log_path=logs / "trainer.log")]
    fleet += [ServiceProcess("rollout", ["--port", "0", "--coordinator", address, "--engine", "hf", "--model", model,
                                         "--engine-args", engine, "--replica-id", f"r{i}"],
                             env={"CUDA_VISIBLE_DEVICES": gpu}, log_path=logs / f"r{i}.log")
              for i, gpu in enumerate(replica_gpus)]
    for p in fleet[1:]:
        p.wait_ready(600)
    with CoordinatorClient(address) as c:
        c.wait_ready(len(fleet) - 1, timeout=600)
    return fleet


def memory(trainer: TrainerClient, replicas: list[RolloutClient]) -> dict:
    return {"trainer_gib": round(trainer.state().device_reserved_bytes / GIB, 2),
            "replicas_gib": [round(r.info().memory.device_reserved_bytes / GIB, 2) for r in replicas],
            "gpu_used_gib": gpu_used()}


def transfer_figures(sync, limit: float, vs: str) -> dict:
    """GB/s of the whole transfer phase (as the coordinator saw it) and of the bytes' own move on
    the receiver, each against the limit, with the profile that says where the rest went."""
    profile = dict(sync.transfer_profile)
    moved = profile.get("receiver_copy") or profile.get("receiver_broadcast") or 0.0
    gbps = sync.bytes / sync.phases["transfer"] / 1e9
    data = sync.bytes / moved / 1e9 if moved else 0.0
    return {"transfer_GB/s": round(gbps, 1), f"transfer_vs_{vs}": round(gbps / limit, 3),
            "copy_GB/s": round(data, 1), f"copy_vs_{vs}": round(data / limit, 3),
            "transfer_profile_ms": {k: round(v * 1e3, 3) for k, v in profile.items()}}


def steady(cycles: list[dict], vs: str) -> dict:
    """Medians over the cycles after the first (which pays one-time setup)."""
    rest = cycles[1:] or cycles
    keys = ["transfer_GB/s", f"transfer_vs_{vs}", "copy_GB/s", f"copy_vs_{vs}"]
    out = {k: round(statistics.median(c[k] for c in rest), 3) for k in keys}
    stages = {k for c in rest for k in c["transfer_profile_ms"]}
    out["transfer_profile_ms"] = {k: round(statistics.median(c["transfer_profile_ms"].get(k, 0.0) for c in rest), 3)
                                  for k in sorted(stages)}
    out["transfer_ms"] = round(statistics.median(c["phases_s"]["transfer"] * 1e3 for c in rest), 3)
    return out


async def generate(address: str, prompts: int, group: int, max_tokens: int):
    async with AsyncCoordinatorClient(address, timeout=None) as c:
        return await asyncio.gather(*(c.complete(f"prompt {i}", n=group, max_tokens=max_tokens, ignore_eos=True,
                                                 logprobs=True, seed=i) for i in range(prompts)))


def colocated(model: str, cycles: int, logs: Path, limit: float) -> dict:
    fleet = start(logs, "colocated", model, "0", ["0"])
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
            sync = c.sync_weights(verify=True)
            m_sync = memory(t, [r])
            phases = {"generate": gen, "sleep": step.metrics.get("sleep_seconds", 0.0),
                      "onload": step.metrics.get("onload_seconds", 0.0),
                      "train": time.perf_counter() - t1 - sync.seconds, **dict(sync.phases)}
            out.append({"cycle": cycle + 1, "version": sync.version, "verified": sync.verified,
                        "phases_s": {k: round(v, 4) for k, v in phases.items()},
                        **transfer_figures(sync, limit, "d2d"), "backends": dict(sync.backends), "bytes": sync.bytes,
                        "memory": {"generating": m_generate, "training": m_train, "after_sync": m_sync}})
            print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    finally:
        for p in reversed(fleet):
            p.stop()
    return {"steady": steady(out, "d2d"), "cycles": out}


def disaggregated(model: str, cycles: int, logs: Path, gpus: int, limit: float) -> dict:
    fleet = start(logs, "async", model, "0", [str(i) for i in range(1, gpus)])
    c = CoordinatorClient(fleet[0].address)
    out, streams = [], {"done": 0, "bad": 0}

    async def background(stop: asyncio.Event):
        async with AsyncCoordinatorClient(fleet[0].address, timeout=None) as gc:
            async def one(i):
                while not stop.is_set():
                    comp = (await gc.complete(f"bg {i}", max_tokens=64, ignore_eos=True))[0]
                    streams["done"] += 1
                    streams["bad"] += len(comp.token_ids) != 64

            await asyncio.gather(*(one(i) for i in range(32)))

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
    return {"steady": steady(out, "nccl"), "cycles": out, "background_streams": streams["done"],
            "lost_or_short": streams["bad"], "aborted_and_resumed": status.resubmissions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--only", choices=("colocated", "disaggregated"), default=None)
    parser.add_argument("--dir", default="/tmp/rlsync-gpu")
    args = parser.parse_args()
    root = Path(args.dir)
    model = str(build_preset(root / args.preset, args.preset, device="cuda"))
    nbytes = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
    gpus = torch.cuda.device_count()
    result = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus, "preset": args.preset, "checkpoint_bytes": nbytes,
              "limits": {"d2d_copy_GB/s": round(d2d_limit(4 << 30, "cuda:0"), 1)}}
    torch.cuda.empty_cache()
    if args.only in (None, "colocated"):
        result["colocated"] = colocated(model, args.cycles, root / "logs-colocated", result["limits"]["d2d_copy_GB/s"])
    if args.only in (None, "disaggregated") and gpus >= 2:
        result["limits"]["nccl_broadcast_GB/s"] = round(nccl_limit(nbytes, 2), 1)
        result["disaggregated"] = disaggregated(model, args.cycles, root / "logs-disaggregated", gpus,
                                                result["limits"]["nccl_broadcast_GB/s"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
