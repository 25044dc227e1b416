"""Weight update time of the embedded tiny model, trainer process -> rollout process, for each
engine (hf, vLLM, SGLang) and CPU channel: offer + prepare, transfer, commit (medians of --updates pushes after one
warm-up), with the transfer's profile and shared-memory copy speed measured in the same run.
Prints JSON.

    python bench/update_tiny.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import memcpy_limit  # noqa: E402

from rlsync.client import RolloutClient, TrainerClient, push_weights  # noqa: E402
from rlsync.launch import ServiceProcess, sglang_python  # noqa: E402

ENGINES = {"hf": {}, "vllm": {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20},
           "sglang": {}}  # in its own environment (make venv-sglang); left out, with the reason, without it


def median_of(reports, field: str) -> dict[str, float]:
    keys = {k for r in reports for k in getattr(r, field)}
    return {k: round(statistics.median(getattr(r, field).get(k, 0.0) for r in reports) * 1e3, 3) for k in sorted(keys)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--backends", default="shm,gloo")
    parser.add_argument("--logs", default="runs/update_tiny")
    args = parser.parse_args()
    out = {"limits": {"memcpy_1_thread_GB/s": round(memcpy_limit(1 << 28, 1), 2)}, "engines": {}}
    for engine, engine_args in ENGINES.items():
        if engine == "sglang" and sglang_python() is None:
            out["engines"][engine] = {"skipped": "no SGLang environment: make venv-sglang"}
            continue
        trainer = ServiceProcess("trainer", ["--port", "0"], log_path=f"{args.logs}/trainer-{engine}.log")
        rollout = ServiceProcess("rollout", ["--port", "0", "--engine", engine,
                                             "--engine-args", json.dumps(engine_args)],
                                 log_path=f"{args.logs}/rollout-{engine}.log")
        try:
            t, r = TrainerClient(trainer.wait_ready(300)), RolloutClient(rollout.wait_ready(300))
            for backend in args.backends.split(","):
                push_weights(t, [r], force_backend=backend)  # warm-up: first connections, group setup
                reports = [push_weights(t, [r], force_backend=backend) for _ in range(args.updates)]
                phases = median_of(reports, "phases")
                out["engines"].setdefault(engine, {})[backend] = {
                    "bytes": reports[0].bytes, "update_ms": round(sum(phases.values()), 3), "phases_ms": phases,
                    "transfer_profile_ms": median_of(reports, "profile")}
        finally:
            rollout.stop()
            trainer.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
