"""`python -m rlsync.coordinator` / `rlsync coordinator`: registry, weight-sync sequences, generation gateway."""

from __future__ import annotations

import argparse
import asyncio
import sys

from rlsync.config import add_arguments, build
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.errors import RlsyncError
from rlsync.rpc.server import run_service, setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsync coordinator", description=__doc__)
    add_arguments(parser, CoordinatorConfig)
    cfg = build(CoordinatorConfig, parser.parse_args(argv))
    setup_logging(cfg.server.log_level)
    from rlsync.coordinator.server import CoordinatorService

    try:
        asyncio.run(run_service(cfg.server, CoordinatorService(cfg)))
    except RlsyncError as e:
        print(f"rlsync coordinator: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
