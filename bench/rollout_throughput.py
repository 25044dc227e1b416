"""Rollout service throughput on the tiny model, for each engine (vLLM, SGLang, hf): tokens/s of one stream and of
many concurrent streams, measured through gRPC by a client in another process. Prints JSON.

    python bench/rollout_throughput.py
"""

from __future__ import annotations

import asyncio
import json
import time

from rlsync.client import AsyncRolloutClient
from rlsync.launch import ServiceProcess, sglang_python

ENGINES = {"vllm": {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 256},
           "sglang": {"max_running_requests": 256},  # in its own environment (make venv-sglang)
           "hf": {"max_num_seqs": 256}}


async def measure(address: str, streams: int, max_tokens: int, repeats: int = 3) -> dict:
    """Median of `repeats` rounds of `streams` concurrent requests (sampled at temperature 1,
    unseeded: a per-request seed costs vLLM a generator of its own)."""
    async with AsyncRolloutClient(address, timeout=None) as c:
        await c.complete("warm up", max_tokens=8, ignore_eos=True)
        rounds = []
        for _ in range(repeats):
            start = time.perf_counter()
            done = await asyncio.gather(*(c.complete(f"prompt {i}", max_tokens=max_tokens, ignore_eos=True)
                                          for i in range(streams)))
            rounds.append((time.perf_counter() - start, sum(len(d[0].token_ids) for d in done)))
    seconds, tokens = sorted(rounds)[len(rounds) // 2]
    return {"streams": streams, "max_tokens": max_tokens, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    out = {}
    for engine, args in ENGINES.items():
        if engine == "sglang" and sglang_python() is None:
            out[engine] = {"skipped": "no SGLang environment: make venv-sglang"}
            continue
        proc = ServiceProcess("rollout", ["--port", "0", "--engine", engine, "--engine-args", json.dumps(args)],
                              log_path=f"runs/throughput/{engine}.log")
        try:
            address = proc.wait_ready(300)
            out[engine] = {"single": asyncio.run(measure(address, 1, 512)),
                           "concurrent": asyncio.run(measure(address, 64, 128))}
        finally:
            proc.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
