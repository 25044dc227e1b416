"""Coordinator configuration (flags and RLSYNC_* environment variables map onto these fields)."""

from __future__ import annotations

import dataclasses

from rlsync.config import ServerConfig, option
from rlsync.checks import StartupError, check_ports, flag, grpc_address, grpc_addresses, refused

DEFAULT_PORT = 50050


def _backend(name: str) -> str | None:
    from rlsync.transfer.handshake import BY_NAME

    if name and name not in BY_NAME:
        return f"unknown backend {name!r}: choose one of {', '.join(BY_NAME)} (or empty: chosen by topology)"
    return None


@dataclasses.dataclass
class CoordinatorConfig:
    server: ServerConfig = dataclasses.field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    sync_mode: str = option("async", "weight-sync sequence: colocated (sleep/wake, offload/onload around each "
                                     "phase), async (broadcast into staging, pause, commit, resume) or inflight "
                                     "(no pause: receive into staging while generating, switch between two engine "
                                     "steps)",
                            choices=("colocated", "async", "inflight"))
    recompute_kv: bool = option(False, "inflight: rebuild the KV cache of requests in flight with the new weights "
                                       "after the switch (default: they continue on the cache the old weights built)")
    trainer: str = option("", "trainer address, for a trainer that does not register itself", check=grpc_address)
    rollouts: list[str] = option(factory=list, help="rollout addresses (comma-separated), for replicas that do "
                                                    "not register themselves", check=grpc_addresses)
    max_staleness: int = option(-1, "versions a trajectory's oldest token may lag the trainer (< 0: unbounded); "
                                    "flagged on the gateway's final chunk and passed to Train")
    stale_policy: str = option("drop", "what Train does with stale trajectories",
                               choices=("keep", "drop", "downweight"))
    heartbeat_interval: float = option(1.0, "seconds between a member's heartbeats", above=0)
    lease: float = option(3.0, "seconds without a heartbeat before a member leaves the rotation", above=0)
    force_backend: str = option("", "transfer backend for every sync (empty: chosen by topology)",
                                check=_backend)
    doorbell: bool = option(True, "let the trainer hand each offer straight to the replicas on its host (their "
                                  "doorbells: a Unix socket instead of a gRPC PrepareUpdate from here)")
    hold_weights: bool = option(True, "replicas on the trainer's GPU (and, outside the colocated mode, those on one "
                                      "other GPU of its host that reads it by P2P, which then pull too) map its "
                                      "weights once, "
                                      "through their "
                                      "doorbells (colocated: at its onload; other modes: with its first offer), "
                                      "and hold them until it offloads or leaves, so an update neither maps "
                                      "nor closes them")
    update_timeout: float = option(300.0, "seconds a weight transfer may take", above=0)
    max_resubmissions: int = option(50, "times the gateway resubmits one completion before giving up", minimum=0)
    max_internal_resubmissions: int = option(
        2, "times the gateway resubmits one completion that replicas failed with an internal error in a row (a "
           "fault in the engine, which a retry seldom cures, not a replica lost) before passing that error on",
        minimum=0)
    http_port: int = option(-1, "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                                "/v1/models) on the gateway, bound to --host; 0 picks a free one; -1: off",
                            minimum=-1, maximum=65535)
    served_model_name: str = option("rlsync", "the model name the HTTP API serves (the 'model' of a request)")

    def check(self) -> None:
        if self.lease <= self.heartbeat_interval:
            raise refused("lease", f"must be longer than {flag('heartbeat_interval')}, {self.heartbeat_interval:g}s, "
                                   f"got {self.lease:g}s: every member would leave the rotation between two heartbeats")
        if self.http_port >= 0:
            server = self.server
            taken = {p: name for name, p in (("port", server.port), ("metrics_port", server.metrics_port)) if p > 0}
            if self.http_port in taken:
                raise StartupError(f"{flag('http_port')} and {flag(taken[self.http_port])} are both "
                                   f"{self.http_port}: give each its own port")
            check_ports(server.host, {"http_port": self.http_port})
