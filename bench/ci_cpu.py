"""Where a command's CPU goes, by kind of process: `python bench/ci_cpu.py -- ./.ci/run`.

Samples every process's user+system time from /proc once a second while the command runs, and sums
each process's growth under a kind read from its command line (a vLLM worker, an SGLang scheduler, a
trainer, a pytest lane, Docker, Ray, ...). Prints one JSON object: the machine's busy CPU seconds over
the run (from /proc/stat, every process's), the seconds attributed to each kind, and what no sample saw
(a process that lived under a second, the last second of one that exited).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")
# (kind, a fragment of the command line), first match wins: an engine's own processes before the service
# that starts them, a service before the interpreter that runs it.
KINDS = (
    ("vllm engine core", "VLLM::EngineCore"), ("vllm worker", "VLLM::Worker"),
    ("sglang scheduler", "sglang::scheduler"), ("sglang detokenizer", "sglang::detokenizer"),
    ("beacon", "rlsync.rpc.beacon"),  # (a member's heartbeats)
    ("preloaded image", "rlsync.preload"), ("demo", "rlsync.demo"),  # (the demo is told its replicas' --engine)
    ("rollout vllm", "--engine vllm"), ("rollout sglang", "--engine sglang"), ("rollout hf", "--engine hf"),
    ("rollout", "rlsync.rollout"), ("trainer", "rlsync.trainer"), ("coordinator", "rlsync.coordinator"),
    ("fleet cli", "rlsync.cli"), ("pytest", "pytest"),
    ("spawned python (unnamed)", "multiprocessing.spawn"), ("ray", "ray"), ("docker", "docker"),
    ("docker", "containerd"), ("pip", "pip"), ("make", "make"),
)


def kind(pid: int, comm: str) -> str | None:
    """The kind of a process now (None: gone, or ending). A service forked from a preloaded image keeps the
    image's command line: its kind comes from the log its output goes to, which the tests name for the service.
    A process that has ended (a zombie its parent has not reaped yet) has no command line left: it keeps the
    kind it had, or its whole time would go under an interpreter that runs nothing (a replica that died in a
    test stays one until the test ends; 217 CPU-s of a CI run went there)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        if not raw:
            return None
        argv = raw.decode(errors="replace").split("\0")
        cmdline = " ".join(argv)
        if "rlsync.preload" in cmdline:
            log = os.path.basename(os.readlink(f"/proc/{pid}/fd/1"))
            if log.endswith(".log") and not log.startswith("preloaded"):
                return f"forked service: {log.removesuffix('.log').rsplit('-', 1)[0]}"  # (the tests': NAME-N.log)
    except OSError:
        return None
    for name, fragment in KINDS:
        if fragment in cmdline or fragment in comm:
            return name
    if comm.startswith("python"):
        script = _script(argv[1:])
        return f"other python: {script if script else f'no script, started by {_parent(pid)}'}"
    return f"other: {comm}"


def _parent(pid: int) -> str:
    """The kind of a process's parent (an interpreter that names no script is known by who started it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{ppid}/comm") as f:
            return kind(ppid, f.read().strip()) or "?"
    except (OSError, ValueError, IndexError):
        return "?"


def _script(args: list[str]) -> str:
    """What an interpreter runs: `-m` and its module, `-c`, or its script's file name ("": none of them)."""
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            return f"-m {args[i + 1]}"
        if a == "-c":
            return "-c"
        if a and not a.startswith("-"):
            return os.path.basename(a)
    return ""


def cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (its comm, user+system ticks) for every process now."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        found[int(entry)] = (comm, int(fields[11]) + int(fields[12]))
    return found


def busy_ticks() -> int:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return user + nice + system + irq + softirq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command to run after --")
    seen: dict[int, list] = {}  # pid -> [comm, ticks at its first sample, ticks at its last, its last kind]
    gone: list[list] = []  # the same, of a process whose pid was then reused
    before = cpu_ticks()
    busy0, t0 = busy_ticks(), time.monotonic()
    proc = subprocess.Popen(command)
    while True:
        done = proc.poll() is not None
        for pid, (comm, ticks) in cpu_ticks().items():
            if pid in seen and seen[pid][0] != comm and seen[pid][2] > ticks:  # its pid reused
                gone.append(seen.pop(pid))
            if pid not in seen:
                start = before[pid][1] if pid in before and before[pid][0] == comm else 0
                seen[pid] = [comm, start, start, None]
            seen[pid][2] = ticks
            # (read at every sample: a spawned process names itself once it has imported, a forked one once
            # it has its log; its whole time goes under the last kind seen)
            seen[pid][3] = kind(pid, comm) or seen[pid][3]
        if done:
            break
        time.sleep(args.interval)
    spent: dict[str, int] = defaultdict(int)
    for comm, start, last, name in [*seen.values(), *gone]:
        spent[name or f"other: {comm}"] += last - start
    busy = (busy_ticks() - busy0) / TICK
    kinds = {k: round(v / TICK, 1) for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v}
    print(json.dumps({"command": command, "returncode": proc.returncode, "wall_s": round(time.monotonic() - t0, 1),
                      "busy_cpu_s": round(busy, 1), "unattributed_cpu_s": round(busy - sum(kinds.values()), 1),
                      "by_kind_cpu_s": kinds}, indent=1))
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
