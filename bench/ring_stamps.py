"""Where a doorbell ring's time goes across the trainer and the replica it rings, from the stamps
the processes wrote with RLSYNC_STAMP_DIR set (rlsync.common.stamps):

    RLSYNC_STAMP_DIR=/tmp/stamps python bench/gpu_cycle.py --only updates --mode inflight --publish-buffer
    python bench/ring_stamps.py /tmp/stamps

Every process's points go on one clock (perf_counter: CLOCK_MONOTONIC). A ring is what lies from one
`ring` point to the next; for each step between two points a ring passes one after the other, in
its order (ring, written, read, parsed, launched, replied, answered, copied, then a sharded trainer's
routed send: queued, job, checked, agreed, rostered, roster, pulled, sent, added, published, asked;
see rlsync.common.stamps), the median, least and most over the rings, in ms. `asked` (the caller's
PublishWeights) comes last where the trainer sent as soon as its ring was answered (the coordinator's
syncs): the step into it is then negative. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ORDER = ["ring", "written", "read", "parsed", "launched", "replied", "answered", "copied",
         # a sharded trainer's routed send (rlsync.publish.core, .ranks; rlsync.transfer.sharded)
         "queued", "job", "checked", "agreed", "rostered", "roster", "pulled", "sent", "added", "published", "asked"]


def rings(folder: Path) -> list[dict[str, float]]:
    """Each ring's first time at each point."""
    points = sorted((float(t), name) for f in folder.glob("*.txt")
                    for name, t in (line.split() for line in f.read_text().splitlines() if line.strip()))
    out: list[dict[str, float]] = []
    for t, name in points:
        if name == "ring":
            out.append({})
        if out and name in ORDER:
            out[-1].setdefault(name, t)
    return out


def steps(found: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per step between two points a ring passed one after the other (of those it passed: a ring that
    launched no pull goes from parsed to replied), over the rings: ms."""
    spans: dict[str, list[float]] = {}
    for r in found:
        passed = [p for p in ORDER if p in r]
        for a, b in zip(passed, passed[1:]):
            spans.setdefault(f"{a}->{b}", []).append((r[b] - r[a]) * 1e3)
    out = {k: {"median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3), "max_ms": round(max(v), 3),
               "rings": len(v)} for k, v in spans.items()}
    whole = [(r["copied"] - r["ring"]) * 1e3 for r in found if "ring" in r and "copied" in r]
    if whole:
        out["ring->copied"] = {"median_ms": round(statistics.median(whole), 3), "rings": len(whole)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    args = parser.parse_args()
    found = rings(Path(args.folder))
    print(json.dumps({"rings": len(found), "steps": steps(found)}, indent=1))


if __name__ == "__main__":
    main()
