"""The trainer's logic: train steps, state, offload/onload, checkpoints. No gRPC here.

One asyncio lock orders everything that touches the weights (a step, an offload, a publish), and
the heavy work runs in a thread so the server keeps answering health checks meanwhile. Publishing
goes through rlsync.publish, the same path a user's own training loop takes. With --nproc N the
policy is sharded over N ranks (one process each, FSDP2), and everything that touches the weights
runs on all of them in the order rank 0 serves it (rlsync.publish.ranks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from rlsync.common import metrics as prometheus
from rlsync.errors import FailedPrecondition, InvalidArgument
from rlsync.models import resolve_model
from rlsync.publish.core import PublisherCore, at_publish_points, in_thread
from rlsync.publish.ranks import TRAIN, PublishPoints, Ranks
from rlsync.publish.source import module_source
from rlsync.address import advertise_host
from rlsync.trainer import checkpoint
from rlsync.trainer.config import TrainerConfig
from rlsync.trainer.grpo import grpo_loss, group_advantages, make_batch, token_logprobs
from rlsync.trainer.mismatch import logprob_gap, tis_weights
from rlsync.trainer.policy import Policy
from rlsync.trainer.v1 import trainer_pb2 as pb
from rlsync.transfer.source import ResidentSource
from rlsync.transfer.v1.transfer_pb2 import LoraAdapter

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

    @classmethod
    def from_proto(cls, t: pb.Trajectory) -> Trajectory:
        return cls(list(t.prompt_ids), list(t.completion_ids), t.reward,
                   t.advantage if t.HasField("advantage") else None, list(t.behavior_logprobs),
                   list(t.token_versions), t.group_id)

    def to_proto(self) -> pb.Trajectory:
        return pb.Trajectory(prompt_ids=self.prompt_ids, completion_ids=self.completion_ids, reward=self.reward,
                             advantage=self.advantage, behavior_logprobs=self.behavior_logprobs,
                             token_versions=self.token_versions, group_id=self.group_id)


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
        self.sharded = cfg.nproc > 1
        self.rank_procs = []
        if self.sharded:
            from rlsync.trainer import ranks
            from rlsync.trainer.sharded import ShardedPolicy

            if cfg.kl_coef > 0:
                raise InvalidArgument("--kl-coef > 0 needs --nproc 1: the KL reference is not sharded yet")
            if cfg.lora_rank > 0:
                raise InvalidArgument("--lora-rank needs --nproc 1: adapters of sharded models are not published yet")
            if cfg.delta:
                raise InvalidArgument("--delta needs --nproc 1: each rank of a sharded trainer sends its own shards "
                                      "and keeps no copy of what it sent to take deltas against")
            if not torch.distributed.is_initialized():  # rank 0; the other ranks joined in ranks.follow
                self.rank_procs = ranks.start_ranks(cfg)
            self.policy = ShardedPolicy(self.model_path, cfg.device, cfg.dtype, cfg.lr, cfg.weight_decay)
        else:
            adapter = LoraAdapter(rank=cfg.lora_rank, alpha=cfg.lora_alpha) if cfg.lora_rank > 0 else None
            self.policy = Policy(self.model_path, cfg.device, cfg.dtype, cfg.lr, cfg.weight_decay, cfg.spool_dir,
                                 adapter, cfg.lora_targets)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        self.vocab_size = self.policy.model.config.vocab_size
        self.max_len = self.policy.model.config.max_position_embeddings
        self.step = 0
        self.lock = asyncio.Lock()
        if self.sharded:  # every rank sends its own shards; every rank serves what rank 0 queues
            source = lambda stacked: module_source(self.policy.model, stacked=stacked)[0]  # noqa: E731
            handlers = {TRAIN: lambda payload: self._train(*ranks.parse_train_payload(payload))}
            rank = Ranks()
            self.points = PublishPoints(rank, lambda: self.publisher.pass_source(rank.rank), handlers)
            run = at_publish_points(self.points)
        else:  # the parameters as they live in the flat store (CPU: in a shared arena a receiver maps)
            def source(stacked: bool) -> ResidentSource:
                sent, frozen = self.policy.published(stacked)
                return ResidentSource(sent, arena=self.policy.arena, adapter=self.policy.adapter, frozen=frozen)
            run = in_thread(self.lock)
        self.publisher = PublisherCore(
            source, run, bucket_bytes=cfg.bucket_bytes, host=cfg.server.host,
            advertise=advertise_host(cfg.server.advertise), checksums=cfg.checksums,
            transfer_timeout=cfg.transfer_timeout, delta=cfg.delta, publish_buffer=cfg.publish_buffer,
            offload=self.policy.offload, onload=self.policy.onload, sharded=self.sharded)
        if self.sharded:  # the publisher's own requests (routed sends, audits) on every rank too
            self.points.handlers.update(self.publisher.rank_handlers(rank))
        self._serving: concurrent.futures.Future | None = None
        if self.sharded and rank.rank == 0:  # rank 0 serves the queue for good; the others follow it
            self._serving = concurrent.futures.Future()
            threading.Thread(target=self.points.serve_until, args=(self._serving,), name="rlsync-ranks",
                             daemon=True).start()

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
        args = (trajectories, self.cfg.max_staleness if max_staleness is None else max_staleness,
                stale_policy or self.cfg.stale_policy, self.cfg.stale_weight if stale_weight is None else stale_weight)
        start = time.perf_counter()
        if self.sharded:  # every rank takes the same step
            from rlsync.trainer.ranks import train_payload

            def step() -> StepResult:
                self._require_on_device("Train")  # where the step runs: after anything queued before it
                return self._train(*args)

            result = await self.publisher.run(step, TRAIN, 0, train_payload(*args))
        else:
            async with self.lock:
                self._require_on_device("Train")
                result = await asyncio.to_thread(self._train, *args)
        prometheus.TRAIN_STEPS.inc()
        prometheus.TRAIN_STEP_SECONDS.observe(time.perf_counter() - start)
        if result.stale:
            prometheus.STALE_DROPPED.labels(args[2]).inc(result.stale)
        return result

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
        sums = {"loss": 0.0, "ratio_mean": 0.0, "clip_frac": 0.0, "kl_sum": 0.0, "gap": 0.0, "gap_tokens": 0.0,
                "tis": 0.0}
        for start in range(0, len(keep), self.cfg.micro_batch):
            idx = keep[start:start + self.cfg.micro_batch]
            ts = [trajectories[i] for i in idx]
            batch = make_batch([t.prompt_ids for t in ts], [t.completion_ids for t in ts],
                               [t.behavior_logprobs for t in ts], [advantages[i] for i in idx],
                               [weights[i] for i in idx], self.pad_id, self.policy.device)
            logprobs = token_logprobs(model, batch)  # the trainer's own, recomputed for the loss
            missing = [j for j, t in enumerate(ts) if not t.behavior_logprobs]
            sampled = batch.target_mask.clone()  # the tokens whose engine logprobs were sent
            sampled[missing] = 0
            gap, gap_tokens = logprob_gap(logprobs, batch.behavior, sampled)
            sums["gap"] += gap
            sums["gap_tokens"] += gap_tokens
            tis = None
            if self.cfg.tis_cap > 0:  # the engine's logprobs weigh the tokens; the ratio is against the trainer's
                tis = tis_weights(logprobs, batch.behavior, self.cfg.tis_cap) * sampled + (1 - sampled)
                sums["tis"] += float((tis * sampled).sum())
                batch.behavior = logprobs.detach() * batch.target_mask
            elif missing:  # no behaviour logprobs: on-policy, the ratio is 1
                batch.behavior[missing] = logprobs.detach()[missing] * batch.target_mask[missing]
            ref = None
            if self.cfg.kl_coef > 0:
                with torch.no_grad(), _swapped(self.policy, self.policy.reference_model_params()):
                    ref = token_logprobs(model, batch)
            loss, stats = grpo_loss(logprobs, batch, self.cfg.clip_eps, total_tokens, ref, self.cfg.kl_coef, tis)
            loss.backward()
            share = stats["tokens"] / total_tokens
            sums["loss"] += float(loss)
            sums["ratio_mean"] += stats["ratio_mean"] * share
            sums["clip_frac"] += stats["clip_frac"] * share
            sums["kl_sum"] += stats["kl_sum"]
        if self.cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable.values(), self.cfg.max_grad_norm)
            metrics["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if self.policy.device.type == "cuda":  # the step ends on the GPU: its time is honest, and a
            torch.cuda.synchronize(self.policy.device)  # publish right after does not queue behind it
        self.step += 1
        metrics.update(loss=sums["loss"], ratio_mean=sums["ratio_mean"], clip_frac=sums["clip_frac"],
                       kl=sums["kl_sum"] / total_tokens, tokens=float(total_tokens),
                       advantage_abs_mean=sum(abs(advantages[i]) for i in keep) / len(keep))
        if sums["gap_tokens"]:  # mean |engine - trainer| logprob over the sampled tokens, before this step's update
            metrics["logprob_gap"] = sums["gap"] / sums["gap_tokens"]
            if self.cfg.tis_cap > 0:
                metrics["tis_weight_mean"] = sums["tis"] / sums["gap_tokens"]
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
        if self.sharded:
            raise FailedPrecondition("checkpoints of a sharded trainer (--nproc > 1) are not written by rlsync yet")
        async with self.lock:
            self._require_on_device("SaveCheckpoint")
            out = await asyncio.to_thread(checkpoint.save, path, self.policy, self.step, self.model_path)
            return str(out)

    async def load(self, path: str) -> int:
        if self.sharded:
            raise FailedPrecondition("checkpoints of a sharded trainer (--nproc > 1) are not read by rlsync yet")
        async with self.lock:
            self.step = await asyncio.to_thread(checkpoint.load, path, self.policy)
            return self.step

    def close(self) -> None:
        self.publisher.close()
        self.policy.close()
        if self._serving is not None:  # the other ranks leave their loop, then the group closes
            self._serving.set_result(None)
            for proc in self.rank_procs:
                proc.wait(60)
            torch.distributed.destroy_process_group()


class _swapped:
    """Temporarily points the model's parameters at other tensors (the frozen reference)."""

    def __init__(self, policy: Policy, tensors: dict[str, torch.Tensor]):
        self.policy, self.tensors = policy, tensors

    def __enter__(self):
        self.saved = {n: self.policy.params[n].data for n in self.tensors}
        for n, t in self.tensors.items():
            self.policy.params[n].data = t

    def __exit__(self, *exc):
        for n, t in self.saved.items():
            self.policy.params[n].data = t
