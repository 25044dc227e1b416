"""Sync time per byte of a mixture of experts against a dense model, through the services: an FSDP2 trainer of 2 ranks
(rlsync's trainer, `--nproc 2`) into a vLLM replica of TP = 2, each behind its own coordinator, on the CPU. Issue 54's
row: the MoE no slower per byte than the dense model in the same run.

The two fleets run side by side and take turns: a round is one RL step of each (4 completions, a train step, a
verified sync), so that the host's load falls on both alike. Reported per round: each sync's seconds, its phases and
the bytes each replica received, and the ratio of the MoE's seconds per byte to the dense model's; then the median,
with a 95% interval of it (a bootstrap over the rounds).

    python bench/moe_sync.py [--experts 28] [--rounds 8]
    python bench/moe_sync.py --experts 128 --layers 48 --rounds 5   # Qwen3-30B-A3B's count of tensors (18 867):
                                        # the work per tensor through the services (its ratio compares unequal sizes)

`--experts 28` builds the tiny MoE with as many bytes as the dense tiny model (0.93 MB bf16): the sync of a model this
small is mostly fixed cost per update, which a per-byte ratio at unequal sizes would charge to the smaller one.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path

import numpy as np

from rlsync.client import CoordinatorClient, RolloutClient, trajectory
from rlsync.launch import ServiceProcess
from rlsync.models import TinyMoeRecipe, ensure_tiny_model, ensure_tiny_moe

VLLM_TP2 = {"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_num_seqs": 8, "tensor_parallel_size": 2,
            "dtype": "float32"}  # float32: the verified sync compares what vLLM loaded bit for bit, as the tests do
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class Fleet:
    """A coordinator, rlsync's trainer over 2 ranks and a vLLM TP = 2 replica, on one model."""

    def __init__(self, name: str, model: Path, logs: Path):
        self.name, self.procs = name, []
        co = self._start("coordinator", ["--port", "0", "--sync-mode", "async"], logs)
        on = ["--coordinator", co.wait_ready(300), "--model", str(model)]
        self._start("trainer", ["--port", "0", *on, "--nproc", "2", "--lr", "0.01"], logs)
        self.replica = self._start("rollout", ["--port", "0", *on, "--engine", "vllm", "--engine-args",
                                               json.dumps(VLLM_TP2)], logs, VLLM_ENV)
        self.client = CoordinatorClient(co.address)

    def _start(self, service: str, args: list[str], logs: Path, env: dict | None = None) -> ServiceProcess:
        proc = ServiceProcess(service, args, env=env, log_path=str(logs / f"{self.name}-{service}.log"),
                              parent_death_signal=signal.SIGTERM)  # (a bench killed takes its fleets with it)
        self.procs.append(proc)
        return proc

    def ready(self) -> None:
        self.replica = RolloutClient(self.replica.wait_ready(600))
        self.client.wait_ready(2)

    def step(self, seed: int) -> dict:
        """One RL step; its verified sync's seconds, phases and the bytes the replica's workers received."""
        done = self.client.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=seed)
        self.client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        sync = self.client.sync_weights(verify=True)
        if not sync.verified:
            raise RuntimeError(f"{self.name}: sync {sync.version} was not verified")
        received = list(self.replica.info().received_bytes)  # (by its last update)
        return {"seconds": round(sync.seconds, 4), "bytes": sum(received), "worker_bytes": received,
                "phases": {k: round(v, 4) for k, v in sync.phases.items()},
                "profile": {k: round(v, 4) for k, v in sync.transfer_profile.items()}}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _medians(rounds: list[dict], part: str) -> dict:
    """Each fleet's median of each figure in `part` ("phases", "profile") over the rounds."""
    return {name: {k: round(statistics.median(r[name][part].get(k, 0.0) for r in rounds), 4)
                   for k in rounds[0][name][part]} for name in rounds[0] if name != "ratio"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=28)
    parser.add_argument("--layers", type=int, default=2, help="the MoE's decoder layers (the dense keeps its own)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="rounds run first and not counted")
    parser.add_argument("--logs", default="runs/moe_sync")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    moe = TinyMoeRecipe(num_experts=args.experts, num_hidden_layers=args.layers)
    models = {"moe": ensure_tiny_moe(moe), "dense": ensure_tiny_model()}
    fleets = {}
    try:
        for name, model in models.items():
            fleets[name] = Fleet(name, model, logs)
        for fleet in fleets.values():
            fleet.ready()
        rounds = []
        for r in range(args.warmup + args.rounds):
            steps = {name: fleet.step(seed=r) for name, fleet in fleets.items()}
            if r >= args.warmup:
                per_byte = {name: s["seconds"] / s["bytes"] for name, s in steps.items()}
                rounds.append({**steps, "ratio": round(per_byte["moe"] / per_byte["dense"], 3)})
                print(json.dumps(rounds[-1]), file=sys.stderr)
    finally:
        for fleet in fleets.values():
            fleet.stop()
    print(json.dumps({"models": {k: str(v) for k, v in models.items()}, "trainer_ranks": 2, "engine": "vllm",
                      "tensor_parallel_size": 2, "rounds": rounds,
                      "seconds_median": {n: statistics.median(r[n]["seconds"] for r in rounds) for n in models},
                      "bytes": {n: rounds[0][n]["bytes"] for n in models}, "phases_median": _medians(rounds, "phases"),
                      "profile_median": _medians(rounds, "profile"),
                      "ratio_median": statistics.median(r["ratio"] for r in rounds),
                      "ratio_median_ci95": _median_ci([r["ratio"] for r in rounds])}))


def _median_ci(values: list[float], resamples: int = 2000) -> list[float]:
    """A 95% interval of the median (a bootstrap over the rounds, seeded): whether a run's median is below a target
    by more than the run's own spread."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(np.asarray(values), size=(resamples, len(values))), axis=1)
    return [round(float(q), 3) for q in np.quantile(medians, [0.025, 0.975])]


if __name__ == "__main__":
    main()
