"""`rlsync demo` (`make demo`): the RL loop on the embedded tiny model, every part a real process:
coordinator, trainer and rollout replica(s) (vLLM's CPU build by default) over gRPC, weights over
shared memory. Shows progress, then writes runs/demo/summary.json and runs/demo/reward.png.
With --fp8 the rollouts are FP8: the trainer trains the tiny FP8 model in bf16 and quantizes each sync."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from rlsync.checks import local_model
from rlsync.client import CoordinatorClient
from rlsync.demo.loop import LoopConfig, StepRecord, run_loop, summarize
from rlsync.demo.task import DigitsTask
from rlsync.launch import ServiceProcess
from rlsync.models import resolve_model

VLLM_ARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 128 << 20, "max_num_seqs": 128}
LORA_RANK = 8
# vLLM's LoRA support, sized for the demo's adapter; two at once, so requests on the last one finish
# while new ones start on the next.
VLLM_LORA_ARGS = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 2}
# vLLM's and SGLang's CPU builds refuse block-FP8 models (their FP8 GEMMs need AMX): the hf engine serves them.
FP8_ENGINE = "hf"
TIS_CAP = 2.0


def start_fleet(args, logs: Path) -> list[ServiceProcess]:
    env = {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    co = ServiceProcess("coordinator", ["--port", "0", "--sync-mode", args.mode, "--max-staleness", "1"],
                        env=env, log_path=logs / "coordinator.log")
    address = co.wait_ready()
    lora = ["--lora-rank", str(LORA_RANK), "--lora-alpha", str(2 * LORA_RANK)] if args.lora else []
    fp8 = ["--dtype", "bfloat16"] if args.fp8 else []  # bf16 training, FP8 serving: quantized on every sync
    tis = ["--tis-cap", str(args.tis)] if args.tis else []
    fleet = [co, ServiceProcess("trainer", ["--port", "0", "--coordinator", address, "--model", args.model,
                                            "--lr", str(args.lr), "--checksums", *lora, *fp8, *tis],
                                env=env, log_path=logs / "trainer.log", name="trainer")]
    vllm_args = {**VLLM_ARGS, **(VLLM_LORA_ARGS if args.lora else {})}
    engine_args = json.dumps(vllm_args if args.engine == "vllm" else {"dtype": "bfloat16"} if args.fp8 else {})
    fleet += [ServiceProcess("rollout", ["--port", "0", "--coordinator", address, "--model", args.model,
                                         "--engine", args.engine, "--engine-args", engine_args,
                                         "--replica-id", f"replica-{i}"],
                             env=env, log_path=logs / f"rollout-{i}.log", name=f"replica-{i}")
              for i in range(args.replicas)]
    for proc in fleet[1:]:
        proc.wait_ready(timeout=300)
    return fleet


def plot(records: list[StepRecord], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    a.plot(steps, [r.reward_mean for r in records], marker="o")
    a.set_ylabel("mean reward")
    a.set_ylim(0, 1)
    a.set_title(title)
    b.bar(steps, [r.sync_seconds * 1000 for r in records])
    b.set_ylabel("weight sync (ms)")
    b.set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsync demo", description=__doc__)
    parser.add_argument("--mode", choices=("colocated", "async", "inflight"), default="async")
    parser.add_argument("--engine", choices=("vllm", "sglang", "hf"), default=None,
                        help="vllm by default (hf with --fp8); sglang runs in its own environment: make venv-sglang "
                             "first")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 5e-3; 3e-2 with --lora)")
    parser.add_argument("--lora", action="store_true",
                        help=f"train a rank-{LORA_RANK} LoRA adapter on the frozen model and sync only the adapter")
    parser.add_argument("--model", default=None, help="tiny by default (tiny-fp8 with --fp8)")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 rollouts: the tiny FP8 model (block e4m3, 128 x 128 scales) served by the hf engine, "
                             "the trainer training in bf16 and quantizing each sync")
    parser.add_argument("--tis", type=float, nargs="?", const=TIS_CAP, default=0.0, metavar="CAP",
                        help="correct the loss for the trainer-vs-engine gap by truncated importance sampling: "
                             f"weight min(p_trainer / p_engine, CAP) per token (CAP {TIS_CAP} if not given)")
    parser.add_argument("--no-sync", action="store_true", help="control run: engines never get new weights")
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.steps < 1:
        parser.error("--replicas and --steps take 1 or more")
    if args.fp8 and args.engine not in (None, FP8_ENGINE):
        parser.error(f"--fp8 with --engine {args.engine}: its CPU build refuses block-FP8 models (its FP8 GEMM needs "
                     f"AMX); the {FP8_ENGINE} engine serves them")
    if args.fp8 and args.lora:
        parser.error("--fp8 with --lora: adapters are synced in their own dtype, there is nothing to quantize")
    if args.tis < 0:
        parser.error("--tis takes a cap > 0")
    args.engine = args.engine or (FP8_ENGINE if args.fp8 else "vllm")
    args.model = args.model or ("tiny-fp8" if args.fp8 else "tiny")
    if problem := local_model(args.model):
        parser.error(f"argument --model: {problem}")
    if args.lr is None:
        args.lr = 3e-2 if args.lora else 5e-3

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)
    args.model = model
    from transformers import AutoTokenizer
    from tqdm import tqdm

    task = DigitsTask(AutoTokenizer.from_pretrained(model), args.max_tokens)
    print(f"rlsync demo: {args.mode} sync, {args.replicas} {args.engine} replica(s), tiny model at {model}"
          + (f", training a rank-{LORA_RANK} LoRA adapter" if args.lora else "")
          + (f"; FP8 rollouts on the {FP8_ENGINE} engine (vLLM's CPU build cannot serve FP8: no AMX), the trainer "
             "training in bf16 and quantizing each sync" if args.fp8 else "")
          + (f"; truncated importance sampling, cap {args.tis}" if args.tis else ""), flush=True)
    start = time.perf_counter()
    fleet = start_fleet(args, out / "logs")
    try:
        with CoordinatorClient(fleet[0].address) as c:
            try:
                c.wait_ready(args.replicas + 1, timeout=120)
            except TimeoutError as e:
                raise SystemExit(f"the fleet did not come up ({e}); see the logs in {out / 'logs'}") from None
        bar = tqdm(total=args.steps, desc="GRPO", unit="step", file=sys.stdout)

        def progress(r: StepRecord) -> None:
            bar.set_postfix(reward=f"{r.reward_mean:.3f}", version=r.version, sync=f"{r.sync_seconds * 1000:.0f}ms",
                            bytes=f"{r.sync_bytes / 1e3:.0f}kB", verified=r.weights_verified,
                            gap="-" if r.logprob_gap is None else f"{r.logprob_gap:.4f}")
            bar.update(1)

        cfg = LoopConfig(args.steps, args.prompts, args.group, args.max_tokens, sync=not args.no_sync)
        records = asyncio.run(run_loop(fleet[0].address, task, cfg, on_step=progress))
        bar.close()
    finally:
        for proc in reversed(fleet):
            proc.stop()
    summary = summarize(records, mode=args.mode, engine=args.engine, replicas=args.replicas, sync=not args.no_sync,
                        model=model, lora_rank=LORA_RANK if args.lora else 0, fp8=args.fp8, tis_cap=args.tis,
                        seconds=round(time.perf_counter() - start, 1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(records, out / "reward.png", f"rlsync demo ({args.mode}, {args.engine}{', FP8' if args.fp8 else ''})")
    synced = [r.sync_bytes for r in records if r.sync_bytes]
    what = "adapter" if args.lora else "weight"
    print(f"reward {summary['reward_first5']:.3f} (first 5 steps) -> {summary['reward_last5']:.3f} (last 5); "
          + (f"{synced[0] / 1e3:.1f} kB of {what} bytes per sync; " if synced else "")
          + (f"trainer-vs-engine logprob gap {summary['logprob_gap_first5']:.4f} (first 5) -> "
             f"{summary['logprob_gap_last5']:.4f} (last 5), max {summary['logprob_gap_max']:.4f} nats; "
             if "logprob_gap_mean" in summary else "")
          + f"wrote {out / 'summary.json'} and {out / 'reward.png'}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
