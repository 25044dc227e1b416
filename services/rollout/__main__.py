"""`python -m rlsync.rollout` / `rlsync rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

import json
import sys

from rlsync.checks import StartupError
from rlsync.rollout.config import RolloutConfig
from rlsync.rpc.server import serve_main


def parse_engine_arg(item: str) -> tuple[str, object]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise StartupError(f"argument -E/--engine-arg: expects KEY=VALUE, got {item!r}")
    try:
        return key.replace("-", "_"), json.loads(raw)
    except json.JSONDecodeError:
        return key.replace("-", "_"), raw


def _engine_arg_flag(parser) -> None:
    parser.add_argument("-E", "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="one engine argument (repeatable; VALUE parsed as JSON when it can be)")


def _merge_engine_args(cfg: RolloutConfig, args) -> None:
    """-E items over --engine-args; the hf engine's are checked here, before anything loads (vLLM's and SGLang's
    own checks need their packages imported: the engine refuses them as it starts)."""
    cfg.engine_args.update(dict(parse_engine_arg(item) for item in args.engine_arg))
    if cfg.engine == "hf":
        from rlsync.rollout.engines.hf_args import HFEngineArgs

        HFEngineArgs.parse(cfg.engine_args)


def _service(cfg: RolloutConfig):
    from rlsync.rollout.server import RolloutService

    return RolloutService(cfg)


def main(argv: list[str] | None = None) -> int:
    return serve_main("rlsync rollout", __doc__, RolloutConfig, _service, argv, _engine_arg_flag, _merge_engine_args)


if __name__ == "__main__":
    sys.exit(main())
