"""The headline figures of bench/gpu_cycle.py results, one file a line (what `make gpu-ab` prints last, so that a
device call's tail shows them): every number of each section, but not its per-sync or per-cycle lists.

    python bench/summary.py runs/ab-old-1.json runs/ab-new-1.json
"""

from __future__ import annotations

import json
import sys


def headline(result: dict) -> dict:
    """{section.key: value} of every number or string in a section (a dict) and one level below it (steady,
    commit_trace, ...), lists left out."""
    out = {}
    for section, figures in result.items():
        if not isinstance(figures, dict) or section in ("limits", "engine_args"):
            continue
        for key, value in figures.items():
            inner = value.items() if isinstance(value, dict) else [("", value)]
            for sub, v in inner:
                if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                    out[f"{section}.{key}{'.' + sub if sub else ''}"] = v
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        try:
            with open(path) as f:
                print(path, json.dumps(headline(json.load(f))))
        except (OSError, ValueError) as e:
            print(path, f"unreadable: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
