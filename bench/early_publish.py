"""The trainer sending as soon as it has rung and prepared every replica (OfferWeightsRequest.publish)
against sending when PublishWeights names them, in the same run: the embedded tiny model, a trainer
and an hf replica on this host, the replica rung at its doorbell; rounds alternate between the two.
Reports the transfer phase (prepare + transfer: offer in hand to bytes in place), medians, with
the medians of the stages each side timed, and over NCCL its ratio to a raw broadcast of the same
bytes measured in the same run. Prints JSON.

    python bench/early_publish.py [--backend gloo] [--rounds 6]
    python bench/early_publish.py --backend nccl --preset qwen3-1.7b   # 2 GPUs: trainer on 0, replica on 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from rlsync.client import RolloutClient, TrainerClient, push_weights
from rlsync.client import weights
from rlsync.launch import ServiceProcess
from rlsync.models import build_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import nccl_limit  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of 10 updates each way")
    parser.add_argument("--preset", default="", help="a real-size model (random weights, built locally) on the GPUs: "
                        "the trainer on GPU 0, the replica on GPU 1 (the embedded tiny model on the CPU otherwise)")
    parser.add_argument("--logs", default="runs/early_publish")
    args = parser.parse_args()
    every_rung = weights._all_rung
    trainer_args, rollout_args, gpu = [], [], [{}, {}]
    if args.preset:
        model = str(build_preset(Path(args.logs) / args.preset, args.preset, device="cuda"))
        trainer_args = ["--model", model, "--device", "cuda", "--dtype", "bfloat16"]
        rollout_args = ["--model", model, "--engine-args", json.dumps({"device": "cuda", "dtype": "bfloat16"})]
        gpu = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    trainer = ServiceProcess("trainer", ["--port", "0", *trainer_args], env=gpu[0], log_path=f"{args.logs}/trainer.log")
    rollout = ServiceProcess("rollout", ["--port", "0", "--engine", "hf", *rollout_args], env=gpu[1],
                             log_path=f"{args.logs}/rollout.log")
    moving: dict[str, list[float]] = {"at_offer": [], "at_publish": []}
    stages: dict[str, list[dict]] = {"at_offer": [], "at_publish": []}
    try:
        t, r = TrainerClient(trainer.wait_ready(300)), RolloutClient(rollout.wait_ready(300))
        bell = r.info().doorbell
        push_weights(t, [r], force_backend=args.backend, doorbells=[bell])  # warm-up
        for _ in range(args.rounds):
            for way in moving:
                weights._all_rung = every_rung if way == "at_offer" else (lambda bells: False)
                for _ in range(10):
                    push = push_weights(t, [r], force_backend=args.backend, doorbells=[bell])
                    moving[way].append((push.phases["prepare"] + push.phases["transfer"]) * 1e3)
                    stages[way].append(dict(push.profile))
    finally:
        weights._all_rung = every_rung
        rollout.stop()
        trainer.stop()
    out = {"backend": args.backend, "updates_each": len(moving["at_offer"]),
           **{f"transfer_phase_ms_{way}": round(statistics.median(v), 3) for way, v in moving.items()}}
    out["saved_ms"] = round(out["transfer_phase_ms_at_publish"] - out["transfer_phase_ms_at_offer"], 3)
    if args.preset and args.backend == "nccl":
        limit = nccl_limit(push.bytes, 2)  # GB/s: the same bytes, GPU 0 to GPU 1
        out["nccl_broadcast_GB/s"] = round(limit, 1)
        for way in moving:
            gbps = push.bytes / out[f"transfer_phase_ms_{way}"] / 1e6
            out[f"transfer_phase_vs_nccl_{way}"] = round(gbps / limit, 3)
    out["stages_ms"] = {way: {k: round(statistics.median(s.get(k, 0.0) for s in runs) * 1e3, 3)
                              for k in sorted({k for s in runs for k in s})} for way, runs in stages.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
