"""The colocated switch, in one process: an hf engine's sleep (its weights to pinned host memory) and
the rlsync trainer's offload and onload (parameters, reference and Adam state), each against the
pinned host<->device rate measured in the same run, with the bytes each really moves and where the
rest of its time goes. The same code the services run (HFEngine.sleep, Policy.offload/onload), without
the RPCs around it. Prints one JSON object.

    python bench/switch.py --preset qwen3-1.7b --cycles 5
    python bench/switch.py --engine vllm   # vLLM's own sleep (level 1: weights to pinned host) and wake_up

With --engine vllm the engine is vLLM (its sleep mode, in one process: VLLMEngine) and the trainer is left
out: its offload and onload are the same code whatever the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cycle import VLLM_ARGS  # noqa: E402
from transfer import _timed  # noqa: E402

from rlsync.models import build_preset
from rlsync.rollout.engines.hf import HFEngine
from rlsync.rollout.types import GenerationRequest, SamplingParams, WakeTag
from rlsync.trainer.policy import Policy

GB = 1e9


def pinned_rates(nbytes: int = 1 << 30) -> dict:
    """GB/s of one pinned host -> device and device -> host copy of `nbytes` (medians of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return {name: round(nbytes / _timed(lambda d=dst, s=src: copy(d, s), 5) / GB, 1)
            for name, dst, src in (("h2d", dev, host), ("d2h", host, dev))}


async def decode(engine: HFEngine, streams: int, tokens: int) -> None:
    """`streams` requests of `tokens` tokens each: the KV cache a replica holds when it is put to sleep."""
    sampling = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in engine.generate(GenerationRequest(f"s{i}", (5, 6, 7, i % 50 + 8), sampling)):
            pass

    await asyncio.gather(*(one(i) for i in range(streams)))


def train_step(policy: Policy) -> None:
    """One AdamW step on random tokens (Adam state exists from the first on), with the reference."""
    policy.reference_model_params()
    ids = torch.randint(0, min(1000, policy.model.config.vocab_size), (4, 128), device=policy.device)
    loss = policy.model(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    policy.optimizer.step()
    policy.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def figure(seconds: list[float], profiles: list[dict], key: str, rate: float) -> dict:
    """Median seconds, bytes moved, GB/s and the ratio to the link's rate, and the median stages (ms)."""
    s = statistics.median(seconds)
    moved = profiles[-1][key]
    stages = {k: round(1e3 * statistics.median(p[k] for p in profiles), 2) for k in profiles[-1] if "bytes" not in k}
    extra = {k: v for k, v in profiles[-1].items() if "bytes" in k and k != key}
    return {"ms": round(s * 1e3, 1), key: moved, "GB/s": round(moved / s / GB, 1),
            "ratio": round(moved / s / GB / rate, 3), "stages_ms": stages, **extra}


async def run(args) -> dict:
    root = Path(tempfile.gettempdir()) / "rlsync-bench-models"
    model = str(build_preset(root / args.preset, args.preset, device="cuda"))
    rates = pinned_rates()
    engine = HFEngine(model, {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 128})
    await engine.start()
    policy = Policy(model, "cuda", "bfloat16", lr=1e-5, weight_decay=0.0, spool_dir="")
    train_step(policy)
    policy.offload()
    times: dict[str, list[float]] = {"sleep": [], "onload": [], "offload": []}
    profiles: dict[str, list[dict]] = {k: [] for k in times}
    idle: list[float] = []  # a sleep with nothing to copy (woken, no update, asleep again)
    try:
        for cycle in range(args.cycles + 1):  # the first one warms up
            await decode(engine, args.streams, args.tokens)
            for name, fn, profile in (("sleep", lambda: engine.sleep(1), engine.switch_profile),
                                      ("onload", policy.onload, policy.switch_profile),
                                      ("train", lambda: train_step(policy), None),
                                      ("offload", policy.offload, policy.switch_profile)):
                start = time.perf_counter()
                done = fn()
                if asyncio.iscoroutine(done):
                    await done
                if cycle and name in times:
                    times[name].append(time.perf_counter() - start)
                    profiles[name].append(dict(profile[name]))
            await engine.wake_up(frozenset({WakeTag.WEIGHTS}))
            start = time.perf_counter()  # woken, not used: the backup still holds these weights
            await engine.sleep(1)
            if cycle:
                idle.append(time.perf_counter() - start)
            await engine.wake_up(frozenset({WakeTag.WEIGHTS, WakeTag.KV_CACHE}))
    finally:
        await engine.shutdown()
        policy.close()
    return {"gpu": torch.cuda.get_device_name(0), "preset": args.preset, "cycles": args.cycles,
            "streams": args.streams, "pinned_GB/s": rates,
            "sleep": figure(times["sleep"], profiles["sleep"], "bytes_to_host", rates["d2h"]),
            "sleep_nothing_to_copy_ms": round(statistics.median(idle) * 1e3, 2),
            "offload": figure(times["offload"], profiles["offload"], "bytes_to_host", rates["d2h"]),
            "onload": figure(times["onload"], profiles["onload"], "bytes_to_device", rates["h2d"])}


async def run_vllm(args) -> dict:
    """vLLM's sleep(1) (weights to pinned host memory, KV cache dropped) and its wake_up of the weights,
    then of the KV cache, each timed from the engine's call to its return (the worker's own copies and
    the RPCs to its process), against the pinned rates."""
    from rlsync.rollout.engines.vllm import VLLMEngine

    root = Path(tempfile.gettempdir()) / "rlsync-bench-models"
    model = str(build_preset(root / args.preset, args.preset, device="cuda"))
    rates = pinned_rates()
    engine = VLLMEngine(model, VLLM_ARGS)  # as the services' replicas in bench/gpu_cycle.py
    await engine.start()
    weights = (await engine.memory()).weights_bytes
    times: dict[str, list[float]] = {"sleep": [], "wake_weights": [], "wake_kv_cache": []}
    try:
        for cycle in range(args.cycles + 1):  # the first one warms up
            await decode(engine, args.streams, args.tokens)
            for name, fn in (("sleep", lambda: engine.sleep(1)),
                             ("wake_weights", lambda: engine.wake_up(frozenset({WakeTag.WEIGHTS}))),
                             ("wake_kv_cache", lambda: engine.wake_up(frozenset({WakeTag.KV_CACHE})))):
                start = time.perf_counter()
                await fn()
                if cycle:
                    times[name].append(time.perf_counter() - start)
    finally:
        await engine.shutdown()

    def fig(name: str, rate: float) -> dict:
        s = statistics.median(times[name])
        return {"ms": round(s * 1e3, 1), "bytes": weights, "GB/s": round(weights / s / GB, 1),
                "ratio": round(weights / s / GB / rate, 3)}

    return {"gpu": torch.cuda.get_device_name(0), "engine": "vllm", "vllm": __import__("vllm").__version__,
            "preset": args.preset, "cycles": args.cycles, "streams": args.streams, "pinned_GB/s": rates,
            "weights_bytes": weights, "sleep": fig("sleep", rates["d2h"]),
            "wake_weights": fig("wake_weights", rates["h2d"]),
            "wake_kv_cache_ms": round(statistics.median(times["wake_kv_cache"]) * 1e3, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/switch.py needs a CUDA GPU")
    print(json.dumps(asyncio.run(run_vllm(args) if args.engine == "vllm" else run(args)), indent=1))


if __name__ == "__main__":
    main()
