"""Summarises the traces a transfer end writes under RLSYNC_TRACE_DIR (rlsync.common.trace): for each,
the transfer's kernels and copies on the GPU (NCCL's, rlsync's copies), the span from the first to
the last, the time they ran, the gaps between them, and how much of their running time other kernels
of the process (an engine's decode) ran beside them. Prints JSON, one object per trace.

    RLSYNC_TRACE_DIR=/tmp/traces python bench/gpu_cycle.py --only disaggregated --cycles 3
    python bench/transfer_trace.py /tmp/traces
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


DEFAULT = 7


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in xs:
        for c, d in ys:
            if d > a and c < b:
                total += min(b, d) - max(a, c)
    return total


def summary(path: Path) -> dict:
    events = json.loads(path.read_text()).get("traceEvents", [])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e]
    # the transfer's work: NCCL's kernels, and anything off the default stream (7 in CUPTI's numbering),
    # where an engine decodes and a trainer trains (rlsync's receiving end has a stream of its own)
    moving = [e for e in gpu if "nccl" in e["name"].lower() or e.get("args", {}).get("stream", DEFAULT) != DEFAULT]
    ids = {id(e) for e in moving}
    others = [e for e in gpu if id(e) not in ids]
    spans = _union(_intervals(moving))
    if not spans:
        return {"trace": path.name, "transfer_kernels": 0}
    busy = sum(b - a for a, b in spans)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    other = _union(_intervals(others))
    streams = sorted({e.get("args", {}).get("stream") for e in moving} - {None})
    names: dict[str, list[float]] = {}
    for e in moving:
        names.setdefault(e["name"][:60], []).append(e.get("dur", 0.0))
    start = min(e["ts"] for e in events if e.get("ph") == "X" and "ts" in e)
    return {"trace": path.name, "transfer_kernels": len(moving), "streams": streams,
            # the host clock, shared by a sender's and a receiver's traces: which end started late
            "trace_start_us": start, "first_kernel_us": spans[0][0], "first_kernel_after_start_ms":
            round((spans[0][0] - start) / 1e3, 3),
            "span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "gaps_ms": round(sum(gaps) / 1e3, 3), "largest_gap_ms": round(max(gaps, default=0.0) / 1e3, 3),
            "other_kernels": len(others), "other_busy_during_ms": round(_overlap(spans, other) / 1e3, 3),
            "by_name": {n: {"count": len(d), "ms": round(sum(d) / 1e3, 3)} for n, d in names.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    args = parser.parse_args()
    for path in sorted(args.folder.glob("*.json"), key=lambda p: p.stem.rsplit("-", 1)[-1]):
        print(json.dumps(summary(path)), flush=True)


if __name__ == "__main__":
    main()
