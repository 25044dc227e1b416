"""`rlsync up | scale | status | logs | down`: a fleet on Ray from the command line.

    rlsync up fleet.yaml                  # local Ray, or --address / RAY_ADDRESS to join a cluster
    rlsync scale rollout=4                # from any shell on a node of that cluster
    rlsync status | rlsync logs rollout-1 | rlsync down
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading
import time

from rlsync.checks import StartupError
from rlsync.errors import RlsyncError


def refusals_exit_2(command):
    """A refusal (a bad fleet file, an unknown group, no such fleet, no Ray cluster) is one line,
    `rlsync <command>: error: <reason>`, and status 2."""
    @functools.wraps(command)
    def run(argv: list[str]) -> int:
        try:
            return command(argv)
        except (RlsyncError, StartupError) as e:
            print(f"rlsync {command.__name__}: error: {e}", file=sys.stderr)
            return 2

    return run


def _no_cluster(address: str | None) -> StartupError:
    """Ray found no cluster to join (its ConnectionError): say where it looked and what to do."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        return StartupError(f"no Ray cluster answers at {address} (from --address or RAY_ADDRESS): is the "
                            "address right, and the cluster up?")
    return StartupError("no Ray cluster runs on this machine: bring a fleet up with `rlsync up FLEET_FILE`, or "
                        "give the cluster's address with --address (or RAY_ADDRESS)")


def _connect(args: argparse.Namespace):
    from rlsync.fleet.launcher import Fleet

    try:
        return Fleet.connect(args.name, args.address)
    except ConnectionError:
        raise _no_cluster(args.address) from None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else "
                        "`up` starts a local Ray and the others find the one on this machine)")


def _named(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--name", default="rlsync", help="the fleet's name (its file's `name`)")


def _print(event: dict) -> None:
    stamp = time.strftime("%H:%M:%S", time.localtime(event["time"]))
    print(f"{stamp} {event['member']:<14} {event['kind']:<10} {event['detail']}", flush=True)


@refusals_exit_2
def up(argv: list[str]) -> int:
    from rlsync.fleet.launcher import Fleet, FleetGone
    from rlsync.fleet.spec import load

    p = argparse.ArgumentParser(prog="rlsync up", description="Start the fleet a fleet file describes, on Ray.")
    p.add_argument("fleet_file")
    _common(p)
    p.add_argument("--detach", action="store_true", help="return once it is up (needs a cluster: --address)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every member")
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"argument --timeout: must be more than 0 seconds, got {args.timeout}")
    spec = load(args.fleet_file)
    if args.detach and not (args.address or os.environ.get("RAY_ADDRESS")):
        p.error("--detach needs a Ray cluster that outlives this command: --address or RAY_ADDRESS")
    try:
        fleet = Fleet.up(spec, args.address, args.timeout, on_event=_print)
    except ConnectionError:
        raise _no_cluster(args.address) from None
    try:
        status = fleet.wait_ready(args.timeout)
    except BaseException:  # not ready, or Ctrl-C: take it down rather than leave it half up
        fleet.down()
        raise
    print(json.dumps({"event": "up", "fleet": spec.name, "coordinator": fleet.coordinator,
                      "members": len(status["members"]), "ray_address": fleet.ray_address}), flush=True)
    if args.detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    seen = fleet.seen
    try:
        while not stop.is_set():
            for event in fleet.events(seen):
                _print(event)
                seen = event["seq"]
            stop.wait(1.0)
    except FleetGone:
        print(f"fleet {spec.name!r} was taken down", file=sys.stderr, flush=True)
        return 0
    print("taking the fleet down", file=sys.stderr, flush=True)
    fleet.down()
    return 0


@refusals_exit_2
def scale(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlsync scale", description="Set rollout groups' replica counts.")
    p.add_argument("counts", nargs="+", metavar="GROUP=N")
    _named(p)
    args = p.parse_args(argv)
    wanted = []
    for item in args.counts:
        group, sep, count = item.partition("=")
        if not sep or not count.isdigit():
            p.error(f"{item!r}: write GROUP=N, e.g. rollout=4")
        wanted.append((group, int(count)))
    fleet = _connect(args)
    for group, count in wanted:
        print(json.dumps(fleet.scale(group, count)), flush=True)
    return 0


@refusals_exit_2
def status(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlsync status", description="Every member: node, address, state.")
    _named(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    s = _connect(args).status()
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"fleet {s['name']} ({s['sync']}), coordinator {s['coordinator']}, weight version {s['weight_version']}")
    for m in s["members"]:
        print(f"  {m['name']:<14} {m['state']:<8} {m['registered'] or '-':<8} v{m['weight_version']:<4} "
              f"{m['backend'] or '-':<8} node {m['node_id'][:12]:<12} {m['address'] or '-':<21} "
              f"restarts {m['restarts']}")
    return 0


@refusals_exit_2
def logs(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlsync logs", description="The end of a member's log.")
    p.add_argument("member")
    _named(p)
    p.add_argument("-n", "--lines", type=int, default=40)
    args = p.parse_args(argv)
    if args.lines < 1:
        p.error(f"argument -n/--lines: must be at least 1, got {args.lines}")
    print(_connect(args).log_tail(args.member, args.lines))
    return 0


@refusals_exit_2
def down(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlsync down", description="Drain and stop every member of a fleet.")
    _named(p)
    args = p.parse_args(argv)
    _connect(args).down()
    return 0


