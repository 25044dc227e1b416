"""Delta updates against full ones, through the whole fleet: real GRPO steps on a bf16 trainer,
synced over gloo to hf replicas, once with --delta and once without, same seeds. Per step: the
fraction of bf16 values the step changed (from the trainer's checkpoints), bytes of the update,
bytes on the wire, and the sync's transfer seconds. Prints JSON.

    python bench/delta.py --steps 20                      # the embedded tiny model
    python bench/delta.py --model qwen3-1.7b --steps 10   # a GPU preset, built locally (random weights)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlsync.client import CoordinatorClient, TrainerClient, trajectory
from rlsync.launch import ServiceProcess
from rlsync.models import build_preset, ensure_tiny_model


def changed_fraction(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for name, t in after.items():
        changed += int((t != before[name]).sum())
        total += t.numel()
    return changed / total


def weights(trainer: TrainerClient, folder: Path) -> dict[str, torch.Tensor]:
    path = Path(trainer.save_checkpoint(str(folder)).path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("model*.safetensors")):  # not the optimizer state beside them
        out.update(load_file(f))
    return out


def run(model: str, delta: bool, steps: int, replicas: int, device: str, logs: Path) -> list[dict]:
    co = ServiceProcess("coordinator", ["--port", "0", "--sync-mode", "async", "--force-backend", "gloo"],
                        log_path=logs / f"coordinator-{delta}.log")
    address = co.wait_ready()
    fleet = [co, ServiceProcess("trainer", ["--port", "0", "--coordinator", address, "--model", model, "--dtype",
                                            "bfloat16", "--lr", "1e-5", "--device", device, "--seed", "0",
                                            *(["--delta"] if delta else [])],
                                log_path=logs / f"trainer-{delta}.log")]
    engine = json.dumps({"dtype": "bfloat16", "device": device})
    fleet += [ServiceProcess("rollout", ["--port", "0", "--coordinator", address, "--model", model, "--engine", "hf",
                                         "--engine-args", engine, "--replica-id", f"r{i}"],
                             log_path=logs / f"r{i}-{delta}.log") for i in range(replicas)]
    rows = []
    try:
        for p in fleet[1:]:
            p.wait_ready(600)
        client = CoordinatorClient(address)
        client.wait_ready(1 + replicas, timeout=600)
        trainer = TrainerClient(fleet[1].address)
        with tempfile.TemporaryDirectory() as tmp:
            before = weights(trainer, Path(tmp) / "0") if delta else None
            for step in range(steps):
                done = client.complete("3+4=", n=8, max_tokens=16, temperature=1.0, logprobs=True, seed=step)
                client.train([trajectory(c, reward=float(i % 2), group_id="g") for i, c in enumerate(done)])
                sync = client.sync_weights(verify=True)
                row = {"step": step + 1, "bytes": sync.bytes, "wire_bytes": sync.wire_bytes,
                       "wire_fraction": round(sync.wire_bytes / sync.bytes, 4),
                       "transfer_s": round(sync.phases["transfer"], 4), "verified": sync.verified}
                if delta:
                    after = weights(trainer, Path(tmp) / str(step + 1))
                    row["changed_fraction"] = round(changed_fraction(before, after), 5)
                    before = after
                rows.append(row)
    finally:
        for p in reversed(fleet):
            p.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (embedded) or a preset (qwen3-1.7b, ...)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logs", default="runs/delta")
    args = parser.parse_args()
    logs = Path(args.logs)
    model = str(ensure_tiny_model()) if args.model == "tiny" else str(build_preset(logs / args.model, args.model,
                                                                                  device=args.device))
    full = run(model, False, args.steps, args.replicas, args.device, logs)
    delta = run(model, True, args.steps, args.replicas, args.device, logs)
    steady = delta[1:]  # the first delta update has no base yet: it goes whole

    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    print(json.dumps({
        "model": args.model, "steps": args.steps, "replicas": args.replicas, "backend": "gloo",
        "bytes_per_update": full[0]["bytes"],
        "median_changed_fraction": median(steady, "changed_fraction"),
        "median_wire_fraction": median(steady, "wire_fraction"),
        "median_transfer_s": {"full": median(full[1:], "transfer_s"), "delta": median(steady, "transfer_s")},
        "transfer_ratio_full_over_delta": round(median(full[1:], "transfer_s") / median(steady, "transfer_s"), 2),
        "all_verified": all(r["verified"] for r in full + delta),
        "per_step": {"full": full, "delta": delta},
    }, indent=1))


if __name__ == "__main__":
    main()
