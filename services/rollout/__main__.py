"""`python -m rlsync.rollout` / `rlsync rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rlsync.config import add_arguments, build
from rlsync.errors import RlsyncError
from rlsync.rollout.config import RolloutConfig
from rlsync.rpc.server import run_service, setup_logging


def parse_engine_arg(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--engine-arg expects KEY=VALUE, got {item!r}")
    try:
        return key.replace("-", "_"), json.loads(raw)
    except json.JSONDecodeError:
        return key.replace("-", "_"), raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsync rollout", description=__doc__)
    add_arguments(parser, RolloutConfig)
    parser.add_argument("-E", "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="one engine argument (repeatable; VALUE parsed as JSON when it can be)")
    args = parser.parse_args(argv)
    cfg = build(RolloutConfig, args)
    cfg.engine_args.update(dict(parse_engine_arg(item) for item in args.engine_arg))
    setup_logging(cfg.server.log_level)
    from rlsync.rollout.server import RolloutService

    try:
        asyncio.run(run_service(cfg.server, RolloutService(cfg)))
    except RlsyncError as e:
        print(f"rlsync rollout: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
