"""What the GPU benches sum up from their runs (pure arithmetic over what a run recorded): where a vLLM update's
gaps go (bench/gpu_cycle.update_trace), the longest gap across an update against those around it
(gap_vs_local_median), what became of the copies replicas armed (armed_copies, from their /metrics), and a result's
headline figures (bench/summary.headline)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_cycle import armed_copies, copies_by_start, gap_vs_local_median, update_trace  # noqa: E402
from summary import headline  # noqa: E402


def test_update_trace_times_each_worker_call_and_the_steps_around_it():
    ms = 1e-3
    events = [("execute_model", 0, 20 * ms), ("sample_tokens", 20 * ms, 21 * ms),
              ("worker_begin", 21.5 * ms, 26 * ms), ("execute_model", 29 * ms, 49 * ms),  # 9 ms between: the begin
              ("execute_model", 53 * ms, 73 * ms),  # 4 ms between: nothing
              ("worker_commit", 74 * ms, 79 * ms), ("execute_model", 84 * ms, 110 * ms),  # 11 ms: the commit
              ("audit", 84 * ms, 120 * ms), ("execute_model", 114 * ms, 134 * ms)]
    trace = update_trace(events)
    assert trace["step_ms"] == pytest.approx(20.0)
    assert trace["first_step_after_commit_ms"] == pytest.approx(26.0)
    assert trace["between_steps_ms"] == pytest.approx(4.0)
    assert trace["worker_begin"] == {"calls": 1, "ms": pytest.approx(4.5),
                                     "between_steps_across_ms": pytest.approx(9.0)}
    assert trace["worker_commit"] == {"calls": 1, "ms": pytest.approx(5.0),
                                      "between_steps_across_ms": pytest.approx(11.0)}


def test_a_trace_without_worker_calls_says_none():
    trace = update_trace([("execute_model", 0.0, 0.02), ("execute_model", 0.024, 0.044)])
    assert trace["worker_commit"] == {"calls": 0, "ms": None, "between_steps_across_ms": None}
    assert trace["first_step_after_commit_ms"] is None and trace["between_steps_ms"] == pytest.approx(4.0)


def test_headline_keeps_every_figure_at_any_depth_and_leaves_lists_and_limits_out():
    result = {"gpu": "H100", "limits": {"d2d_copy_GB/s": 1484.0},
              "updates_inflight": {"throughput_ratio": 0.9, "per_sync": [{"seconds": 1.0}], "aborted": False,
                                   "update_trace": {"step_ms": 20.0, "worker_commit": {"ms": 5.0, "calls": 8}}}}
    assert headline(result) == {"updates_inflight.throughput_ratio": 0.9, "updates_inflight.update_trace.step_ms": 20.0,
                                "updates_inflight.update_trace.worker_commit.ms": 5.0,
                                "updates_inflight.update_trace.worker_commit.calls": 8}


def test_an_updates_gap_is_weighed_against_the_gaps_around_it_not_the_whole_runs():
    def stream(start: float, step: float, n: int) -> list[tuple[float, float, float]]:
        return [(step, start + i * step, start + (i + 1) * step) for i in range(n)]

    # one round at 10 ms a token with an update whose gap is 25 ms; a slower round (20 ms) whose update's is 30 ms
    fast = stream(0.0, 0.010, 40) + [(0.025, 0.400, 0.425)] + stream(0.425, 0.010, 40)
    slow = stream(5.0, 0.020, 20) + [(0.030, 5.400, 5.430)] + stream(5.430, 0.020, 20)
    windows = [(0.405, 0.420), (5.405, 5.420)]
    assert gap_vs_local_median(fast + slow, windows) == pytest.approx(2.5)  # 25 / 10, not 30 / a run-wide median
    assert gap_vs_local_median(fast, [(2.0, 2.01)]) is None  # no gap across that update
    assert gap_vs_local_median(fast + slow, windows, around=0.0) is None  # no gap starts at the update's own start


def test_each_syncs_copy_is_counted_by_how_it_began_on_the_replica():
    per_sync = [{"transfer_profile_ms": {"receiver_adopt": 0.01, "receiver_copied": 2.0}},
                {"transfer_profile_ms": {"receiver_launch": 0.3}}, {"transfer_profile_ms": {"receiver_setup": 0.7}},
                {}]
    assert copies_by_start(per_sync) == {"adopted": 1, "launched": 1, "other": 2}


class _Endpoint:
    """A replica as the bench knows it (a ServiceProcess): where its /metrics listen."""

    def __init__(self, address: str):
        self.address = address

    def http_address(self, event: str) -> str:
        assert event == "metrics"
        return self.address


def test_armed_copies_are_summed_by_outcome_over_the_replicas_metrics():
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    endpoints = []
    for adopted, late in ((3, 1), (2, 0)):
        registry = CollectorRegistry()
        armed = Counter("rlsync_replica_armed_copies", "(as rlsync.common.metrics)", ["outcome"], registry=registry)
        armed.labels("adopted").inc(adopted)
        armed.labels("late").inc(late)
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        endpoints.append((server, _Endpoint(f"127.0.0.1:{server.server_port}")))
    try:
        assert armed_copies([e for _, e in endpoints]) == {"adopted": 5, "late": 1}
        assert armed_copies([]) == {}
    finally:
        for server, _ in endpoints:
            server.shutdown()
