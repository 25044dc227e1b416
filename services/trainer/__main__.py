"""`python -m rlsync.trainer` / `rlsync trainer`: serve a policy for GRPO-style training over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import sys

from rlsync.config import add_arguments, build
from rlsync.errors import RlsyncError
from rlsync.rpc.server import run_service, setup_logging
from rlsync.trainer.config import TrainerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsync trainer", description=__doc__)
    add_arguments(parser, TrainerConfig)
    cfg = build(TrainerConfig, parser.parse_args(argv))
    setup_logging(cfg.server.log_level)
    from rlsync.trainer.server import TrainerService

    try:
        asyncio.run(run_service(cfg.server, TrainerService(cfg)))
    except RlsyncError as e:
        print(f"rlsync trainer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
