"""Prometheus metrics (prometheus_client), served on a service's --metrics-port at /metrics.

One set of metric objects per process (the default registry, with the process collectors: CPU,
memory, file descriptors). Each service records into the ones it owns; gauges of live state read
it when scraped (set_function), so nothing is updated twice.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, make_asgi_app

# Seconds from 100 µs to 100 s: one update's stages (a copy of milliseconds) up to a cold NCCL setup.
_SECONDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 100)

# -- the coordinator: weight syncs -------------------------------------------------------------------
SYNCS = Counter("rlsync_syncs", "weight syncs that completed", ["mode"])
SYNC_SECONDS = Histogram("rlsync_sync_seconds", "a weight sync end to end (without the verify audit)", ["mode"],
                         buckets=_SECONDS)
SYNC_PHASE_SECONDS = Histogram("rlsync_sync_phase_seconds", "each phase of a weight sync (offer, prepare, "
                               "transfer, commit, pause, resume, wake_weights, offload, ...)", ["mode", "phase"],
                               buckets=_SECONDS)
SYNC_BYTES = Counter("rlsync_sync_bytes", "bytes sent to replicas by weight syncs, per transfer backend",
                     ["backend"])
SYNC_WIRE_BYTES = Counter("rlsync_sync_wire_bytes", "payload bytes the trainer sent in weight syncs (below "
                          "rlsync_sync_bytes when delta updates sent only what changed)")
TRANSFER_GBPS = Gauge("rlsync_transfer_gbps", "GB/s of the last sync's transfer phase (prepare + publish), "
                      "per backend", ["backend"])
FLEET_VERSION = Gauge("rlsync_fleet_weight_version", "the weight version the fleet serves")
TRAINER_STEP = Gauge("rlsync_trainer_step", "the trainer's step, as the coordinator last heard it")
REPLICAS = Gauge("rlsync_replicas", "rollout replicas, by state (ready, all, suspect)", ["state"])

# -- the coordinator: liveness (the registry's lease, fed by evidence of progress) -------------------------
MEMBERS_SUSPECTED = Counter("rlsync_members_suspected", "members suspected after half a lease without progress, by "
                            "role and reason: silent (nothing heard) or stalled (heartbeats that show no progress)",
                            ["role", "reason"])
MEMBERS_CLEARED = Counter("rlsync_members_cleared", "suspected members that showed progress again, by role and the "
                          "evidence: heartbeat, tokens, answer", ["role", "evidence"])
MEMBERS_DROPPED = Counter("rlsync_members_dropped", "members that left the fleet, by role and reason: silent or "
                          "stalled (a lease without progress), dead (found dead by a sync), replaced (registered "
                          "again), left (said why), deregistered (in order), catch_up_failed", ["role", "reason"])

# -- the coordinator: the gateway ---------------------------------------------------------------------
GATEWAY_REQUESTS = Counter("rlsync_gateway_requests", "generation requests taken by the gateway (gRPC or HTTP)")
GATEWAY_IN_FLIGHT = Gauge("rlsync_gateway_requests_in_flight", "gateway requests being answered")
GATEWAY_WAITING = Gauge("rlsync_gateway_waiting", "completions waiting for a ready replica (queue depth)")
RESUBMISSIONS = Counter("rlsync_gateway_resubmissions", "completions resubmitted, by what cut them short: aborted "
                        "(the replica ended them: an update's pause, a sleep, a drain), replica_lost (the registry "
                        "dropped the replica), replica_failed (the call failed otherwise)", ["reason"])
STALE_FLAGGED = Counter("rlsync_gateway_stale_completions", "completions whose oldest token lags the trainer by "
                        "more than max_staleness")

# -- a rollout replica ---------------------------------------------------------------------------------
REPLICA_VERSION = Gauge("rlsync_replica_weight_version", "the weight version this replica serves")
REPLICA_IN_FLIGHT = Gauge("rlsync_replica_requests_in_flight", "requests this replica is generating")
REPLICA_REQUESTS = Counter("rlsync_replica_requests", "Generate requests this replica admitted")
REPLICA_ABORTED = Counter("rlsync_replica_completions_aborted", "completions ended by an abort (Abort, a pause "
                          "with abort, sleep, shutdown)")
REPLICA_TOKENS = Counter("rlsync_replica_tokens", "tokens generated")
REPLICA_ARMED = Counter("rlsync_replica_armed_copies", "copies armed beside generation (hf arm_while_generating), "
                        "by what became of them: adopted by the next offer, let_go (a step ran far longer than usual), "
                        "late (the trainer's bell had not reached it when its offer came), stopped (another offer, "
                        "a sleep, a hold or release, the batch's need for room)", ["outcome"])

# -- the trainer ------------------------------------------------------------------------------------
TRAIN_STEPS = Counter("rlsync_train_steps", "training steps taken")
TRAIN_STEP_SECONDS = Histogram("rlsync_train_step_seconds", "one training step", buckets=_SECONDS)
STALE_DROPPED = Counter("rlsync_train_stale_trajectories", "trajectories past max_staleness, by what the "
                        "step did with them", ["policy"])


def metrics_app():
    """The ASGI app that serves /metrics (Prometheus text format)."""
    return make_asgi_app()
