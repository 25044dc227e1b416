"""The coordinator's liveness figures, read from its Prometheus endpoint (--metrics-port): members suspected,
cleared and dropped (by role and reason) and gateway resubmissions (by reason); `samples` reads any process's."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

SERIES = {"rlsync_members_suspected_total": "suspected", "rlsync_members_cleared_total": "cleared",
          "rlsync_members_dropped_total": "dropped", "rlsync_gateway_resubmissions_total": "resubmitted"}


def samples(metrics_address: str) -> list:
    """Every sample a process's Prometheus endpoint (--metrics-port) serves now."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=30).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def liveness(metrics_address: str) -> dict[str, dict[str, float]]:
    """{"suspected": {"rollout/silent": 1.0, ...}, "cleared": ..., "dropped": ..., "resubmitted": {"aborted": ..}}"""
    out: dict[str, dict[str, float]] = {name: {} for name in SERIES.values()}
    for s in samples(metrics_address):
        if s.name in SERIES and s.value:
            key = "/".join(s.labels[k] for k in ("role", "reason", "evidence") if k in s.labels)
            out[SERIES[s.name]][key] = s.value
    return out


def add(total: dict[str, dict[str, float]], more: dict[str, dict[str, float]]) -> None:
    """Adds one coordinator process's figures to `total` (a restarted coordinator counts from 0)."""
    for name, by in more.items():
        for key, value in by.items():
            total.setdefault(name, {})[key] = total.get(name, {}).get(key, 0) + value


def lease_drops(figures: dict[str, dict[str, float]]) -> float:
    """Members dropped for a lease without progress (silent or stalled) or found dead by a sync."""
    return sum(v for k, v in figures.get("dropped", {}).items() if k.split("/")[-1] in ("silent", "stalled", "dead"))
