"""The headline figures of bench/gpu_cycle.py results, one file a line (what `make gpu-ab` prints last, so that a
device call's tail shows them): every number of each section, at any depth, but not its per-sync or per-cycle lists.

    python bench/summary.py runs/ab-old-1.json runs/ab-new-1.json
"""

from __future__ import annotations

import json
import sys


def headline(result: dict) -> dict:
    """{section.key...: value} of every number or string in the result's sections (its dicts), at any depth, lists
    (per sync, per cycle) left out."""
    out = {}

    def walk(figures: dict, at: str) -> None:
        for key, value in figures.items():
            if isinstance(value, dict):
                walk(value, f"{at}.{key}")
            elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
                out[f"{at}.{key}"] = value

    for section, figures in result.items():
        if isinstance(figures, dict) and section not in ("limits", "engine_args"):
            walk(figures, section)
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
