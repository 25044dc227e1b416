"""What the GPU benches sum up from their runs (pure arithmetic over what a run recorded): where a vLLM update's
gaps go (bench/gpu_cycle.update_trace), and a result's headline figures (bench/summary.headline)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_cycle import update_trace  # noqa: E402
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
