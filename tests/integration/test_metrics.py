"""Prometheus metrics: a real coordinator, trainer and hf replica with --metrics-port; after generating,
training and a sync, each one's /metrics has the series with plausible values."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from conftest import rollout_args
from rlsync.client import CoordinatorClient, trajectory


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an endpoint's /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_after_generating_training_and_a_sync(services):
    metrics = ["--metrics-port", "0"]
    co = services.start("coordinator", [*metrics, "--sync-mode", "async"], name="co-metrics")
    tr = services.start("trainer", [*metrics, "--coordinator", co.address], name="tr-metrics")
    ro = services.start("rollout", [*rollout_args("hf"), *metrics, "--coordinator", co.address], name="ro-metrics")
    with CoordinatorClient(co.address) as fleet:
        fleet.wait_ready(2)
        done = fleet.complete("3+4=", n=4, max_tokens=8, ignore_eos=True, logprobs=True, seed=1)
        fleet.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        sync = fleet.sync_weights()

    c = scrape(co.http_address("metrics"))
    assert c[("rlsync_syncs_total", (("mode", "async"),))] == 1
    assert c[("rlsync_sync_seconds_count", (("mode", "async"),))] == 1
    assert 0 < c[("rlsync_sync_seconds_sum", (("mode", "async"),))] < 60
    for phase in ("offer", "prepare", "transfer", "pause", "commit", "resume"):
        assert c[("rlsync_sync_phase_seconds_count", (("mode", "async"), ("phase", phase)))] == 1, phase
    assert c[("rlsync_sync_bytes_total", (("backend", "shm"),))] == sync.bytes > 0
    assert c[("rlsync_transfer_gbps", (("backend", "shm"),))] > 0
    assert c[("rlsync_fleet_weight_version", ())] == c[("rlsync_trainer_step", ())] == 1
    assert c[("rlsync_replicas", (("state", "ready"),))] == 1
    assert c[("rlsync_gateway_requests_total", ())] == 1 and c[("rlsync_gateway_requests_in_flight", ())] == 0
    assert c[("process_resident_memory_bytes", ())] > 0

    r = scrape(ro.http_address("metrics"))
    assert r[("rlsync_replica_weight_version", ())] == 1
    assert r[("rlsync_replica_requests_total", ())] == 4  # the gateway sends each of n=4 alone
    assert r[("rlsync_replica_tokens_total", ())] == 32 and r[("rlsync_replica_requests_in_flight", ())] == 0

    t = scrape(tr.http_address("metrics"))
    assert t[("rlsync_train_steps_total", ())] == 1 and t[("rlsync_train_step_seconds_count", ())] == 1
    assert 0 < t[("rlsync_train_step_seconds_sum", ())] < 60
