"""Members that are busy, not hung: busy loops starve the CPU (2x the cores; RLSYNC_TEST_BURN sets
another factor) while two replicas stream through the gateway and an in-flight sync lands under them.
Every member stays in the fleet and nothing is resubmitted: tokens streamed, answers and heartbeats
whose progress moves keep each one's lease, however late they come. Under the same starvation, a
replica that hangs (SIGSTOP) still leaves within its lease and its streams finish on the other. A
member that keeps its GIL for several leases stays while it computes and leaves while it does nothing;
one that dies leaves at once. Real processes and gRPC throughout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import rollout_args
from hangs import FAST, LEASE
from rlsync.client import CoordinatorClient
from rlsync.coordinator.v1 import coordinator_pb2 as pb
from streams import Stream
from test_metrics import scrape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from burn import burning, load_of  # noqa: E402

STREAMS, TOKENS = 40, 160
LOAD = float(os.environ.get("RLSYNC_TEST_BURN", "2"))  # busy loops per core (4: what bench/results reports too)


def test_a_starved_fleet_keeps_every_member_and_an_inflight_sync_resubmits_nothing(services):
    co = services.start("coordinator", ["--sync-mode", "inflight", *FAST, "--metrics-port", "0"], name="coordinator")
    services.start("trainer", ["--coordinator", co.address], name="trainer")
    ros = [services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--replica-id", f"r{i}"],
                          name=f"r{i}") for i in range(2)]
    client = CoordinatorClient(co.address)
    client.wait_ready(3)
    with burning(load_of(LOAD)):
        started = time.monotonic()
        streams = [Stream(client, f"busy {i}", max_tokens=TOKENS, ignore_eos=True, seed=i) for i in range(STREAMS)]
        assert all(s.first.wait(120) for s in streams), "the streams never started"
        sync = client.sync_weights(version=1)
        for s in streams:
            s.thread.join(300)
        print(f"\n[busy] {STREAMS} streams of {TOKENS} tokens and an in-flight sync under {load_of(LOAD)} busy loops: "
              f"{time.monotonic() - started:.1f}s; {liveness(co)}")
        assert sync.version == 1 and sync.replicas == 2
        complete(streams)
        status = client.status()
        assert rollouts(client) == ["r0", "r1"] and "dropped" not in liveness(co), "a busy member was dropped"
        assert status.resubmissions == 0 and all(s.chunks[-1].resubmissions == 0 for s in streams), "none resubmitted"
        assert any(len(set(s.versions())) == 2 for s in streams), "the sync landed under streams in flight"

        # The other side, under the same load: a replica that makes no progress at all leaves within its lease.
        streams = [Stream(client, f"hung {i}", max_tokens=TOKENS, ignore_eos=True, seed=i) for i in range(10)]
        assert all(s.first.wait(120) for s in streams)
        os.killpg(ros[1].proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            deadline = stopped + 60
            while rollouts(client) != ["r0"]:
                assert time.monotonic() < deadline, "the hung replica never left"
                time.sleep(0.05)
            print(f"\n[busy] a hung replica under {load_of(LOAD)} busy loops left in {time.monotonic() - stopped:.1f}s "
                  f"(lease {LEASE}s)")
            for s in streams:
                s.thread.join(300)
        finally:
            os.killpg(ros[1].proc.pid, signal.SIGCONT)
    complete(streams)
    assert "rollout silent: 1" in liveness(co), liveness(co)


def complete(streams: list[Stream]) -> None:
    assert [s.error for s in streams if s.error] == []
    assert all(s.tokens == TOKENS and s.chunks[-1].finish_reason for s in streams), "every stream complete"


def rollouts(client: CoordinatorClient) -> list[str]:
    return sorted(m.name for m in client.status().members if m.role == pb.ROLE_ROLLOUT)


def liveness(co) -> str:
    """The coordinator's liveness counters, e.g. "suspected: rollout silent: 2" (none: "")."""
    figures = scrape(co.http_address("metrics"))
    parts = []
    for name in ("suspected", "cleared", "dropped"):
        found = [f"{dict(k[1])['role']} {dict(k[1]).get('reason', dict(k[1]).get('evidence'))}: {v:g}"
                 for k, v in figures.items() if k[0] == f"rlsync_members_{name}_total"]
        if found:
            parts.append(f"{name}: {', '.join(found)}")
    return "; ".join(parts)


def test_a_member_that_keeps_its_gil_stays_while_it_computes_and_leaves_when_it_does_nothing_or_dies(services):
    """Its heartbeats leave from its beacon, a process of its own (rlsync.rpc.beacon), with its CPU time."""
    co = services.start("coordinator", ["--sync-mode", "async", *FAST, "--metrics-port", "0"], name="coordinator")
    client = CoordinatorClient(co.address)
    member = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "gil_member.py"), co.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert member.stdout.readline() == "registered\n"
        assert trainers(client) == ["gil"]

        held = ask(member, "busy", 3 * LEASE)  # no heartbeat thread of its own could run meanwhile
        assert trainers(client) == ["gil"] and "dropped" not in liveness(co), (held, liveness(co))

        ask(member, "idle", 2 * LEASE)  # its GIL kept, nothing done: its beacon's heartbeats show no progress
        assert "dropped: trainer stalled: 1" in liveness(co), liveness(co)
        wait_for(lambda: trainers(client) == ["gil"], "it registers again once it works again")

        before, dropped = members(client), drops(co)
        beacon = children(member.pid)
        os.kill(beacon[0], signal.SIGKILL)  # its beacon dies: the member starts another, which goes on as it
        wait_for(lambda: children(member.pid) not in ([], beacon), "the member starts another beacon")
        time.sleep(LEASE)
        if members(client) != before:  # the new beacon's start took longer than a lease (a loaded host, as CI's start
            # was once): nothing was heard meanwhile, so the lease dropped it, and the new beacon registers it again;
            # or the new beacon registered anew and the coordinator replaced the old entry (fresh1 of stop 83, when a
            # failed heartbeat made a beacon register again; now only a page torn by the kill could)
            now = drops(co)
            why = "silent" if "trainer silent: 1" in now else "replaced" if "trainer replaced: 1" in now else None
            assert "silent" not in dropped and why is not None, (now, dropped)
            wait_for(lambda: trainers(client) == ["gil"], "it registers again")
            print(f"\n[busy] its beacon's replacement registered anew ({why}), and the member stays")
        else:
            assert drops(co) == dropped, "the same member, never dropped"

        silent = dropped_for(co, "silent")
        os.kill(member.pid, signal.SIGKILL)  # the member alone: its beacon sees it go
        killed = time.monotonic()
        wait_for(lambda: trainers(client) == [], "the dead member leaves")
        took = time.monotonic() - killed
        print(f"\n[busy] a member holding its GIL for {held} stayed; killed, it left in "
              f"{took:.2f}s (lease {LEASE}s); {liveness(co)}")
        if "trainer left: 1" not in liveness(co):  # its new beacon, starved on a loaded host (fresh43, CI's start),
            # had not been heard for most of a lease when the member died: the lease dropped it first (its check ticks)
            assert dropped_for(co, "silent") == silent + 1 and took <= 2 * LEASE, (took, liveness(co))
            print("\n[busy] the dead member's beacon was late: the lease dropped it silent first")
    finally:
        os.killpg(member.pid, signal.SIGKILL)
        member.wait()


def ask(member: subprocess.Popen, what: str, seconds: float) -> str:
    member.stdin.write(f"{what} {seconds}\n")
    member.stdin.flush()
    answer = member.stdout.readline().split()
    assert answer[:1] == ["done"], answer
    return f"{answer[1]}s"


def dropped_for(co, reason: str) -> int:
    """How many trainers the coordinator dropped for `reason` (silent, stalled, left)."""
    found = re.search(rf"trainer {reason}: (\d+)", drops(co))
    return int(found.group(1)) if found else 0


def drops(co) -> str:
    """The drop counters alone (a new beacon starting under load may be late enough to be suspected)."""
    return liveness(co).partition("dropped: ")[2]


def children(pid: int) -> list[int]:
    """Its child processes, whichever of its threads started each (a beacon started again: a worker thread)."""
    return sorted(int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in _read(t / "children").split())


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # (a thread that just ended)
        return ""


def members(client: CoordinatorClient) -> list[str]:
    return sorted(m.id for m in client.status().members)


def trainers(client: CoordinatorClient) -> list[str]:
    return sorted(m.name for m in client.status().members if m.role == pb.ROLE_TRAINER)


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
