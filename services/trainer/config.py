"""Trainer configuration (flags and RLSYNC_* environment variables map onto these fields)."""

from __future__ import annotations

import dataclasses

from rlsync.config import ServerConfig, option

DEFAULT_PORT = 50052


@dataclasses.dataclass
class TrainerConfig:
    server: ServerConfig = dataclasses.field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    model: str = option("tiny", "model folder, or 'tiny' for the locally built default model")
    device: str = option("auto", "training device: auto (cuda when available), cpu, cuda, cuda:N")
    dtype: str = option("auto", "parameter dtype: auto (the checkpoint's), float32, bfloat16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    lr: float = option(1e-3, "AdamW learning rate")
    weight_decay: float = option(0.0, "AdamW weight decay")
    clip_eps: float = option(0.2, "PPO/GRPO ratio clipping")
    kl_coef: float = option(0.0, "weight of the KL penalty to the initial policy (0 = no reference model)")
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)")
    micro_batch: int = option(32, "trajectories per forward/backward (gradients accumulate)")
    seed: int = option(0, "torch seed")
    max_staleness: int = option(-1, "default staleness bound for Train (< 0: unbounded)")
    stale_policy: str = option("drop", "what Train does with stale trajectories by default",
                               choices=("keep", "drop", "downweight"))
    stale_weight: float = option(0.1, "loss scale of stale trajectories under the downweight policy")
    bucket_bytes: int = option(256 << 20, "weight transfer bucket size")
    checksums: bool = option(False, "checksum every published tensor and bucket (verified by receivers)")
    delta: bool = option(False, "delta updates: broadcasts (gloo, nccl) to replicas that hold the last version send "
                                "only the 16-bit words that changed, verified bit for bit (keeps one more copy of "
                                "the weights on the trainer's device; not with --nproc > 1)")
    lora_rank: int = option(0, "train a LoRA adapter of this rank on the frozen model (peft) and sync only the "
                                "adapter; 0 trains and syncs every weight")
    lora_alpha: float = option(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank")
    lora_targets: str = option("all-linear", "modules the adapter wraps: 'all-linear', or comma-separated names "
                                             "(q_proj,v_proj)")
    transfer_timeout: float = option(300.0, "seconds a weight transfer may take")
    spool_dir: str = option("", "where a CPU trainer offloads to (default: a temporary folder)")
    coordinator: str = option("", "coordinator address (host:port) to register with; empty = standalone")
    nproc: int = option(1, "ranks to train with: > 1 shards the model over that many processes with FSDP2 "
                           "(gloo on CPU; NCCL with one GPU per rank)")
