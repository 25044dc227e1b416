"""One GRPO loop against a running coordinator: generate groups through the gateway, score them,
train, sync the weights. The demo, the example and the tests all run this."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rlsync.client import AsyncCoordinatorClient, trajectory
from rlsync.demo.task import PROMPTS, DigitsTask


@dataclass
class LoopConfig:
    steps: int = 30
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    sync: bool = True  # False: the engines never see the new weights (the control experiment)
    verify: bool = True  # compare trainer and engine checksums after every sync
    seed: int = 0


@dataclass
class StepRecord:
    step: int
    reward_mean: float
    version: int
    sync_seconds: float
    weights_verified: bool
    phases: dict[str, float] = field(default_factory=dict)
    generate_seconds: float = 0.0
    train_seconds: float = 0.0
    sync_bytes: int = 0  # what the sync moved: the whole model, or a LoRA adapter
    logprob_gap: float | None = None  # mean |engine - trainer| logprob over the step's sampled tokens
    tis_weight_mean: float | None = None  # the truncated importance weights' mean, with --tis


async def run_loop(coordinator: str, task: DigitsTask, cfg: LoopConfig, token: str = "",
                   on_step: Callable[[StepRecord], None] | None = None) -> list[StepRecord]:
    rng = random.Random(cfg.seed)
    records = []
    async with AsyncCoordinatorClient(coordinator, token=token, timeout=None) as c:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            prompts = rng.sample(PROMPTS, cfg.prompts_per_step) if cfg.prompts_per_step <= len(PROMPTS) else \
                [rng.choice(PROMPTS) for _ in range(cfg.prompts_per_step)]
            groups = await asyncio.gather(*(
                c.complete(p, n=cfg.group_size, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                           logprobs=True, seed=rng.randrange(1 << 30)) for p in prompts))
            t1 = time.perf_counter()
            batch, rewards = [], []
            for g, completions in enumerate(groups):
                for comp in completions:
                    r = task.reward(comp.token_ids)
                    rewards.append(r)
                    batch.append(trajectory(comp, r, group_id=f"{step}-{g}"))
            trained = (await c.train(batch)).metrics
            t2 = time.perf_counter()
            version, sync_s, verified, phases, nbytes = (await c.status()).weight_version, 0.0, False, {}, 0
            if cfg.sync:
                s = await c.sync_weights(verify=cfg.verify)
                version, sync_s, verified, phases, nbytes = s.version, s.seconds, s.verified, dict(s.phases), s.bytes
            rec = StepRecord(step + 1, sum(rewards) / len(rewards), version, sync_s, verified, phases, t1 - t0, t2 - t1,
                             nbytes, trained.get("logprob_gap"), trained.get("tis_weight_mean"))
            records.append(rec)
            if on_step:
                on_step(rec)
    return records


def summarize(records: list[StepRecord], **meta) -> dict:
    def mean(rs: list[StepRecord]) -> float:
        return sum(r.reward_mean for r in rs) / max(1, len(rs))

    first, last = mean(records[:5]), mean(records[-5:])
    gaps = [r.logprob_gap for r in records if r.logprob_gap is not None]
    gap = {"logprob_gap_mean": sum(gaps) / len(gaps), "logprob_gap_max": max(gaps),
           "logprob_gap_first5": sum(gaps[:5]) / len(gaps[:5]), "logprob_gap_last5": sum(gaps[-5:]) / len(gaps[-5:])} \
        if gaps else {}
    return {**meta, "steps": [asdict(r) for r in records], "reward_first5": first, "reward_last5": last,
            "improvement": last - first, **gap}
