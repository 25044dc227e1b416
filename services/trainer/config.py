"""Trainer configuration (flags and RLSYNC_* environment variables map onto these fields)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from rlsync.config import ServerConfig, option
from rlsync.checks import StartupError, flag, grpc_address, local_model, refused

DEFAULT_PORT = 50052


def _device(device: str) -> str | None:
    """auto, cpu, cuda or cuda:N, N a GPU this host has."""
    if device == "auto":
        return None
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        return f"{device!r} is not a training device: auto, cpu, cuda or cuda:N"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            return f"{device!r}: no CUDA device here ({why}); use cpu, or auto"
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            return f"{device!r}: this host has {count} GPU(s), cuda:0 to cuda:{count - 1}"
    return None


def _spool(folder: str) -> str | None:
    """Empty (a temporary folder), or a folder that exists or can be made, and can be written."""
    if not folder:
        return None
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return f"{folder} is not a folder"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{folder}: {existing} is not writable"
    return None


@dataclasses.dataclass
class TrainerConfig:
    server: ServerConfig = dataclasses.field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    model: str = option("tiny", "model folder (or the name of a model in the local Hugging Face cache: nothing is "
                                "downloaded), or 'tiny' for the locally built default model", check=local_model)
    device: str = option("auto", "training device: auto (cuda when available), cpu, cuda, cuda:N",
                         check=_device)
    dtype: str = option("auto", "parameter dtype: auto (the checkpoint's), float32, bfloat16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    lr: float = option(1e-3, "AdamW learning rate", minimum=0)
    weight_decay: float = option(0.0, "AdamW weight decay", minimum=0)
    clip_eps: float = option(0.2, "PPO/GRPO ratio clipping", above=0)
    kl_coef: float = option(0.0, "weight of the KL penalty to the initial policy (0 = no reference model)", minimum=0)
    tis_cap: float = option(0.0, "truncated importance sampling: scale each token's policy-gradient loss by "
                                 "min(p_trainer / p_engine, this cap), the PPO ratio then taken against the trainer's "
                                 "own logprobs (corrects for an engine that samples with other numerics, e.g. FP8); "
                                 "0 = off: the ratio is taken against the engine's logprobs", minimum=0)
    max_grad_norm: float = option(1.0, "gradient clipping (0 = off)", minimum=0)
    micro_batch: int = option(32, "trajectories per forward/backward (gradients accumulate)", minimum=1)
    seed: int = option(0, "torch seed", minimum=-(1 << 63), maximum=(1 << 64) - 1)  # what torch.manual_seed takes
    max_staleness: int = option(-1, "default staleness bound for Train (< 0: unbounded)")
    stale_policy: str = option("drop", "what Train does with stale trajectories by default",
                               choices=("keep", "drop", "downweight"))
    stale_weight: float = option(0.1, "loss scale of stale trajectories under the downweight policy", minimum=0)
    bucket_bytes: int = option(256 << 20, "weight transfer bucket size", minimum=1)
    checksums: bool = option(False, "checksum every published tensor and bucket (verified by receivers)")
    delta: bool = option(False, "delta updates: broadcasts (gloo, nccl) to replicas that hold the last version send "
                                "only the 16-bit words that changed, verified bit for bit (keeps one more copy of "
                                "the weights on the trainer's device; not with --nproc > 1)")
    publish_buffer: bool = option(False, "copy the weights into a buffer of their own at each update the coordinator "
                                         "does not keep the trainer still for (inflight, async): replicas on its GPU "
                                         "copy from it while training goes on (keeps one more copy of the weights on "
                                         "the trainer's GPU; a CUDA trainer of one process)")
    lora_rank: int = option(0, "train a LoRA adapter of this rank on the frozen model (peft) and sync only the "
                                "adapter; 0 trains and syncs every weight", minimum=0)
    lora_alpha: float = option(16.0, "LoRA alpha: the adapter's update is scaled by alpha / rank", above=0)
    lora_targets: str = option("all-linear", "modules the adapter wraps: 'all-linear', or comma-separated names "
                                             "(q_proj,v_proj)")
    transfer_timeout: float = option(300.0, "seconds a weight transfer may take", above=0)
    spool_dir: str = option("", "where a CPU trainer offloads to (default: a temporary folder)",
                            check=_spool)
    coordinator: str = option("", "coordinator address (host:port) to register with; empty = standalone",
                              check=grpc_address)
    nproc: int = option(1, "ranks to train with: > 1 shards the model over that many processes with FSDP2 "
                           "(gloo on CPU; NCCL with one GPU per rank; gloo where ranks share GPUs, a slow step)",
                        minimum=1)

    def on_cuda(self) -> bool:
        """Whether the trainer trains on a GPU (auto: when one is visible)."""
        if self.device == "auto":
            import torch

            return torch.cuda.is_available()
        return self.device.startswith("cuda")

    def check(self) -> None:
        if self.publish_buffer and (self.delta or self.nproc > 1 or not self.on_cuda()):
            raise refused("publish_buffer", "copies the weights of one CUDA process: not with --delta (its broadcasts "
                                            "send from the trainer's own copy), --nproc > 1 or a CPU --device")
        if self.lora_rank > 0 and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise refused("lora_targets", "names no module: 'all-linear', or comma-separated names (q_proj,v_proj)")
        if self.nproc > 1 and self.device.startswith("cuda"):
            import torch

            if not torch.cuda.device_count():
                raise StartupError(f"{flag('nproc')} {self.nproc} with {flag('device')} {self.device}: this host "
                                   "has no GPU")
