"""The gateway under load (bench/gateway_load.py): 200 concurrent streams, 3 weight updates mid-flight.
Asserts correctness only; the benchmark reports the latencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway_load.py"


@pytest.mark.parametrize("mode", ["async", "inflight"])
def test_no_stream_lost_or_duplicated_through_three_updates(tmp_path, mode):
    # Three syncs back to back, each started while the streams run (they last seconds; a sync ~0.1 s).
    out = subprocess.run([sys.executable, str(BENCH), "--streams", "200", "--updates", "3", "--max-tokens", "128",
                          "--sync-mode", mode, "--no-latency", "--logs", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    result = json.loads(out.stdout)
    load = result["load"]
    assert out.returncode == 0 and load["lost_or_wrong"] == 0, load["problems"]
    assert load["streams"] == 200 and [u["version"] for u in load["updates"]] == [1, 2, 3]
    assert all(u["streams_open"] > 0 for u in load["updates"]), f"an update came after the streams: {load}"
    assert load["versions_seen"] == [0, 1, 2, 3], "tokens were made by every version"
    if mode == "async":
        assert load["resubmissions"] > 0, "updates aborted requests in flight, and the gateway resubmitted them"
    else:
        assert load["resubmissions"] == 0 and load["gateway_resubmissions_total"] == 0, "inflight aborts nothing"
        assert all("pause" not in u["phases"] for u in load["updates"]), load["updates"]
        assert load["spanning_streams"] > 0, "some streams carried two versions: the switch happened under them"
