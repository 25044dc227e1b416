"""The `rlsync` command: one entry point for services, tools and the demo."""

from __future__ import annotations

import argparse
import importlib
import sys

from rlsync.checks import StartupError

# subcommand -> (module with main(argv), or module:function(argv); one-line help)
COMMANDS = {
    "demo": ("rlsync.demo.run", "run the RL demo on the tiny model (coordinator, trainer, replicas)"),
    "coordinator": ("rlsync.coordinator.__main__", "registry, weight-sync sequences and generation gateway"),
    "rollout": ("rlsync.rollout.__main__", "serve one inference engine (vLLM, SGLang or hf) over gRPC"),
    "trainer": ("rlsync.trainer.__main__", "serve a policy: GRPO-style steps, offload/onload, weight publishing"),
    "make-tiny-model": ("rlsync.models", "build the embedded default model and print its folder"),
    "transfer-check": ("rlsync.transfer.check", "move a safetensors file to another process over one backend "
                       "and verify it bit for bit"),
    "up": ("rlsync.fleet.cli:up", "start the fleet a fleet file describes, on Ray (a local one, or --address)"),
    "scale": ("rlsync.fleet.cli:scale", "set rollout groups' replica counts: rlsync scale rollout=4"),
    "status": ("rlsync.fleet.cli:status", "a fleet's members: node, address, state, weight version"),
    "logs": ("rlsync.fleet.cli:logs", "the end of a fleet member's log"),
    "down": ("rlsync.fleet.cli:down", "drain and stop every member of a fleet"),
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
    module, _, function = COMMANDS[argv[0]][0].partition(":")
    try:
        return getattr(importlib.import_module(module), function or "main")(argv[1:]) or 0
    except StartupError as e:  # a value the command cannot start with: one line, as argparse says a bad flag
        print(f"rlsync {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
