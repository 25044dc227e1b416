"""A trainer over N ranks (`rlsync trainer --nproc N`): the service process is rank 0 and serves gRPC;
it starts ranks 1..N-1 as processes of their own (`python -m rlsync.trainer.ranks <config>`), which
build the same sharded policy and then follow rank 0: every training step, publish pass and
offload runs on all ranks at once (rlsync.publish.ranks carries what comes next, as protobuf bytes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from rlsync.config import ServerConfig
from rlsync.trainer.config import TrainerConfig
from rlsync.trainer.v1 import trainer_pb2 as pb

log = logging.getLogger(__name__)

STALE_POLICIES = {pb.STALE_POLICY_KEEP: "keep", pb.STALE_POLICY_DROP: "drop", pb.STALE_POLICY_DOWNWEIGHT: "downweight"}


def backend(cfg: TrainerConfig) -> str:
    """NCCL with a GPU per rank; gloo on the CPU, and where ranks share GPUs (NCCL takes no two ranks on one
    GPU; gloo carries CUDA tensors through host memory: a slow step, but a sharded trainer on one GPU)."""
    if not cfg.on_cuda():
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= cfg.nproc else "cpu:gloo,cuda:gloo"


def start_ranks(cfg: TrainerConfig) -> list[subprocess.Popen]:
    """Rank 0: starts the other ranks, then joins the process group with them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(cfg.nproc)}
    config = json.dumps(dataclasses.asdict(cfg))
    procs = [subprocess.Popen([sys.executable, "-m", "rlsync.trainer.ranks", config], stdin=subprocess.DEVNULL,
                              env={**os.environ, **common, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(1, cfg.nproc)]  # their output goes where the service's goes: its log
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    if backend(cfg) != "nccl" and cfg.on_cuda():
        log.warning("%d ranks on %d GPU(s): gloo carries the gradients through host memory (a slow step; NCCL "
                    "takes no two ranks on one GPU)", cfg.nproc, torch.cuda.device_count())
    _init(cfg)
    return procs


def _init(cfg: TrainerConfig) -> None:
    if cfg.on_cuda():  # rank r on GPU r (of as many as there are), chosen before anything touches CUDA
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    # Ranks 1..N-1 wait in a broadcast between requests: rank 0 keeps them alive (KEEPALIVE_SECONDS).
    dist.init_process_group(backend(cfg))


def train_payload(trajectories, bound: int, policy: str, weight: float) -> bytes:
    """A training step for the other ranks, as protobuf."""
    code = {v: k for k, v in STALE_POLICIES.items()}[policy]
    return pb.TrainRequest(trajectories=[t.to_proto() for t in trajectories], max_staleness=bound,
                           stale_policy=code, stale_weight=weight).SerializeToString()


def parse_train_payload(payload: bytes):
    from rlsync.trainer.core import Trajectory

    r = pb.TrainRequest.FromString(payload)
    return ([Trajectory.from_proto(t) for t in r.trajectories], r.max_staleness, STALE_POLICIES[r.stale_policy],
            r.stale_weight)


def follow(config: str) -> None:
    """Ranks 1..N-1: the same policy as rank 0, then whatever rank 0 runs, until it stops."""
    from rlsync.trainer.core import TrainerCore

    raw = json.loads(config)
    cfg = TrainerConfig(**{**raw, "server": ServerConfig(**raw["server"])})
    _init(cfg)
    core = TrainerCore(cfg)
    try:
        core.points.serve_until(None)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    follow(sys.argv[1])
