"""`python -m rlsync.coordinator` / `rlsync coordinator`: registry, weight-sync sequences, generation gateway."""

from __future__ import annotations

import sys

from rlsync.coordinator.config import CoordinatorConfig
from rlsync.rpc.server import serve_main


def _service(cfg: CoordinatorConfig):
    from rlsync.coordinator.server import CoordinatorService

    return CoordinatorService(cfg)


def main(argv: list[str] | None = None) -> int:
    return serve_main("rlsync coordinator", __doc__, CoordinatorConfig, _service, argv)


if __name__ == "__main__":
    sys.exit(main())
