"""Regenerates the Python stubs of every proto under protos/ (`make protos`); `--check` fails when stale.

Stubs for package `rlsync.<area>.v1` land in the folder that holds the Python package
`rlsync.<area>`: services/<area>/v1 for a service, libs/rlsync/<area>/v1 for a library.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"


def area_dir(area: str) -> Path:
    service = ROOT / "services" / area
    return service if service.is_dir() else ROOT / "libs" / "rlsync" / area


def generate(out: Path) -> dict[Path, Path]:
    """Runs protoc into `out`; returns {generated file: where it belongs in the tree}."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (see the messages above)")
    placed = {}
    for path in sorted(out.rglob("*.py*")):
        if path.name.endswith("_pb2_grpc.py") and "Stub" not in path.read_text():
            continue  # a proto without services: no gRPC module
        rel = path.relative_to(out)  # rlsync/<area>/v1/<name>
        _, area, version, name = rel.parts
        placed[path] = area_dir(area) / version / name
    return placed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if committed stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        placed = generate(Path(tmp))
        stale = [dst for src, dst in placed.items() if not dst.exists() or not filecmp.cmp(src, dst, shallow=False)]
        if args.check:
            for dst in stale:
                print(f"stale generated stub: {dst.relative_to(ROOT)}", file=sys.stderr)
            if stale:
                print("run `make protos` and commit the result", file=sys.stderr)
            return 1 if stale else 0
        for src, dst in placed.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            (dst.parent / "__init__.py").touch()
            shutil.copyfile(src, dst)
        print(f"generated {len(placed)} files; {len(stale)} changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
