"""Rollout replica configuration (flags and RLSYNC_* environment variables map onto these fields)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlsync.config import ServerConfig, option
from rlsync.checks import grpc_address, local_model

DEFAULT_PORT = 50051


@dataclasses.dataclass
class RolloutConfig:
    server: ServerConfig = dataclasses.field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    engine: str = option("vllm", "inference engine (sglang runs in its own environment: make venv-sglang)",
                         choices=("vllm", "hf", "sglang"))
    model: str = option("tiny", "model folder (or the name of a model in the local Hugging Face cache: nothing is "
                                "downloaded), or 'tiny' for the locally built default model", check=local_model)
    engine_args: dict[str, Any] = option(factory=dict, help="JSON object of engine arguments, passed "
                                         "through with the engine's own defaults (vLLM: tensor_parallel_size, "
                                         "max_num_seqs, dtype, enforce_eager, ...)")
    replica_id: str = option("", "name of this replica in logs and GetInfo; random when empty")
    update_timeout: float = option(300.0, "seconds a weight update may take to arrive", above=0)
    coordinator: str = option("", "coordinator address (host:port) to register with; empty = standalone",
                              check=grpc_address)
    coordinator_lease: float = option(30.0, "seconds the coordinator may stay unreachable while it has this "
                                      "replica paused, asleep or holding a prepared update; then the replica drops "
                                      "the update, wakes and resumes on the weights it has (0: wait forever)",
                                      minimum=0)
