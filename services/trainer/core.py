"""The trainer's logic: train steps, state, offload/onload, checkpoints. No gRPC here.

One asyncio lock orders everything that touches the weights (a step, an offload, a publish), and
the heavy work runs in a thread so the server keeps answering health checks meanwhile. Publishing
goes through rlsync.publish, the same path a user's own training loop takes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from rlsync.errors import FailedPrecondition, InvalidArgument
from rlsync.models import resolve_model
from rlsync.publish.core import PublisherCore, in_thread
from rlsync.trainer import checkpoint
from rlsync.trainer.config import TrainerConfig
from rlsync.trainer.grpo import grpo_loss, group_advantages, make_batch, token_logprobs
from rlsync.trainer.policy import Policy
from rlsync.transfer.source import ResidentSource

log = logging.getLogger(__name__)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    advantage: float | None = None
    behavior_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    group_id: str = ""


@dataclass
class StepResult:
    step: int
    metrics: dict[str, float]
    used: int
    stale: int
    dropped: int


class TrainerCore:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.model_path = resolve_model(cfg.model)
        torch.manual_seed(cfg.seed)
        self.policy = Policy(self.model_path, cfg.device, cfg.dtype, cfg.lr, cfg.weight_decay, cfg.spool_dir)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.vocab_size = self.policy.model.config.vocab_size
        self.max_len = self.policy.model.config.max_position_embeddings
        self.step = 0
        self.lock = asyncio.Lock()
        # The parameters as they live in the flat store (CPU: in a shared arena a receiver maps).
        self.publisher = PublisherCore(
            lambda: ResidentSource(self.policy.params, arena=self.policy.arena), in_thread(self.lock),
            bucket_bytes=cfg.bucket_bytes, host=cfg.server.host, advertise=cfg.advertise or None,
            checksums=cfg.checksums, transfer_timeout=cfg.transfer_timeout,
            offload=self.policy.offload, onload=self.policy.onload)

    def _require_on_device(self, action: str) -> None:
        if self.policy.offloaded:
            raise FailedPrecondition(f"trainer is offloaded: call Onload before {action}")

    # ---- training -------------------------------------------------------------------------------
    def _check(self, trajectories: list[Trajectory]) -> None:
        if not trajectories:
            raise InvalidArgument("Train needs at least one trajectory")
        for i, t in enumerate(trajectories):
            where = f"trajectory {i}"
            if not t.prompt_ids or not t.completion_ids:
                raise InvalidArgument(f"{where}: prompt_ids and completion_ids must both be non-empty")
            bad = [x for x in t.prompt_ids + t.completion_ids if not 0 <= x < self.vocab_size]
            if bad:
                raise InvalidArgument(f"{where}: token ids {bad[:3]} outside the vocabulary [0, {self.vocab_size})")
            if len(t.prompt_ids) + len(t.completion_ids) > self.max_len:
                raise InvalidArgument(f"{where}: {len(t.prompt_ids) + len(t.completion_ids)} tokens exceed the "
                                      f"model's {self.max_len}")
            if t.behavior_logprobs and len(t.behavior_logprobs) != len(t.completion_ids):
                raise InvalidArgument(f"{where}: {len(t.behavior_logprobs)} behavior_logprobs for "
                                      f"{len(t.completion_ids)} completion tokens (give one per token, or none)")
            if t.token_versions and len(t.token_versions) != len(t.completion_ids):
                raise InvalidArgument(f"{where}: {len(t.token_versions)} token_versions for "
                                      f"{len(t.completion_ids)} completion tokens")
            if any(v > self.step for v in t.token_versions):
                raise InvalidArgument(f"{where}: token version {max(t.token_versions)} is newer than the "
                                      f"trainer's step {self.step}")

    async def train(self, trajectories: list[Trajectory], max_staleness: int | None = None,
                    stale_policy: str | None = None, stale_weight: float | None = None) -> StepResult:
        self._check(trajectories)
        async with self.lock:
            self._require_on_device("Train")
            bound = self.cfg.max_staleness if max_staleness is None else max_staleness
            return await asyncio.to_thread(self._train, trajectories, bound, stale_policy or self.cfg.stale_policy,
                                           self.cfg.stale_weight if stale_weight is None else stale_weight)

    def _train(self, trajectories: list[Trajectory], bound: int, policy: str, stale_weight: float) -> StepResult:
        groups = [t.group_id or ",".join(map(str, t.prompt_ids)) for t in trajectories]
        computed = group_advantages([t.reward for t in trajectories], groups)
        advantages = [t.advantage if t.advantage is not None else a for t, a in zip(trajectories, computed)]
        weights, stale = [], 0
        for t in trajectories:
            lag = self.step - min(t.token_versions) if t.token_versions else 0
            is_stale = bound >= 0 and lag > bound
            stale += is_stale
            weights.append(0.0 if is_stale and policy == "drop" else
                           stale_weight if is_stale and policy == "downweight" else 1.0)
        keep = [i for i, w in enumerate(weights) if w > 0]
        metrics = {"reward_mean": sum(t.reward for t in trajectories) / len(trajectories)}
        if not keep:
            return StepResult(self.step, {**metrics, "loss": 0.0}, 0, stale, len(trajectories))
        total_tokens = sum(len(trajectories[i].completion_ids) for i in keep)
        model, opt = self.policy.model, self.policy.optimizer
        sums = {"loss": 0.0, "ratio_mean": 0.0, "clip_frac": 0.0, "kl_sum": 0.0}
        for start in range(0, len(keep), self.cfg.micro_batch):
            idx = keep[start:start + self.cfg.micro_batch]
            ts = [trajectories[i] for i in idx]
            batch = make_batch([t.prompt_ids for t in ts], [t.completion_ids for t in ts],
                               [t.behavior_logprobs for t in ts], [advantages[i] for i in idx],
                               [weights[i] for i in idx], self.pad_id, self.policy.device)
            logprobs = token_logprobs(model, batch)
            missing = [j for j, t in enumerate(ts) if not t.behavior_logprobs]
            if missing:  # no behaviour logprobs: on-policy, the ratio is 1
                batch.behavior[missing] = logprobs.detach()[missing] * batch.target_mask[missing]
            ref = None
            if self.cfg.kl_coef > 0:
                with torch.no_grad(), _swapped(self.policy, self.policy.reference_model_params()):
                    ref = token_logprobs(model, batch)
            loss, stats = grpo_loss(logprobs, batch, self.cfg.clip_eps, total_tokens, ref, self.cfg.kl_coef)
            loss.backward()
            share = stats["tokens"] / total_tokens
            sums["loss"] += float(loss)
            sums["ratio_mean"] += stats["ratio_mean"] * share
            sums["clip_frac"] += stats["clip_frac"] * share
            sums["kl_sum"] += stats["kl_sum"]
        if self.cfg.max_grad_norm > 0:
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.params.values(),
                                                                        self.cfg.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.step += 1
        metrics.update(loss=sums["loss"], ratio_mean=sums["ratio_mean"], clip_frac=sums["clip_frac"],
                       kl=sums["kl_sum"] / total_tokens, tokens=float(total_tokens),
                       advantage_abs_mean=sum(abs(advantages[i]) for i in keep) / len(keep))
        return StepResult(self.step, metrics, len(keep), stale, len(trajectories) - len(keep))

    # ---- memory ---------------------------------------------------------------------------------
    def device_reserved(self) -> int:
        d = self.policy.device
        if d.type == "cuda":
            return torch.cuda.memory_reserved(d)
        import psutil

        return psutil.Process().memory_info().rss

    # ---- checkpoints ----------------------------------------------------------------------------
    async def save(self, path: str) -> str:
        if not path:
            raise InvalidArgument("SaveCheckpoint needs a path")
        async with self.lock:
            self._require_on_device("SaveCheckpoint")
            out = await asyncio.to_thread(checkpoint.save, path, self.policy, self.step, self.model_path)
            return str(out)

    async def load(self, path: str) -> int:
        async with self.lock:
            self.step = await asyncio.to_thread(checkpoint.load, path, self.policy)
            return self.step

    def close(self) -> None:
        self.publisher.close()
        self.policy.close()


class _swapped:
    """Temporarily points the model's parameters at other tensors (the frozen reference)."""

    def __init__(self, policy: Policy, tensors: dict[str, torch.Tensor]):
        self.policy, self.tensors = policy, tensors

    def __enter__(self):
        self.saved = {n: p.data for n, p in self.policy.params.items()}
        for n, p in self.policy.params.items():
            p.data = self.tensors[n]

    def __exit__(self, *exc):
        for n, p in self.policy.params.items():
            p.data = self.saved[n]
