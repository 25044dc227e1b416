"""The `rlsync` command: one entry point for services, tools and the demo."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with main(argv), one-line help)
COMMANDS = {
    "demo": ("rlsync.demo.run", "run the RL demo on the tiny model (coordinator, trainer, replicas)"),
    "coordinator": ("rlsync.coordinator.__main__", "registry, weight-sync sequences and generation gateway"),
    "rollout": ("rlsync.rollout.__main__", "serve one inference engine (vLLM or hf) over gRPC"),
    "trainer": ("rlsync.trainer.__main__", "serve a policy: GRPO-style steps, offload/onload, weight publishing"),
    "make-tiny-model": ("rlsync.models", "build the embedded default model and print its folder"),
    "transfer-check": ("rlsync.transfer.check", "move a safetensors file to another process over one backend "
                       "and verify it bit for bit"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="rlsync", description="rlsync: keep inference engines in step "
                                         "with a trainer during RL post-training.")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text)
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}")
        parser.print_help()
        return 0 if argv else 2
    module, _ = COMMANDS[argv[0]]
    return importlib.import_module(module).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
