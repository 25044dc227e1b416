"""`python -m rlsync.trainer` / `rlsync trainer`: serve a policy for GRPO-style training over gRPC."""

from __future__ import annotations

import sys

from rlsync.rpc.server import serve_main
from rlsync.trainer.config import TrainerConfig


def _service(cfg: TrainerConfig):
    from rlsync.trainer.server import TrainerService

    return TrainerService(cfg)


def main(argv: list[str] | None = None) -> int:
    return serve_main("rlsync trainer", __doc__, TrainerConfig, _service, argv)


if __name__ == "__main__":
    sys.exit(main())
