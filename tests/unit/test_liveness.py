"""The registry's liveness rules (rlsync.coordinator.liveness): progress, not punctuality, decides who
stays; suspect at half the lease, dropped at the lease."""

from __future__ import annotations

import asyncio

import pytest

from rlsync.common.progress import CPU_ALONE
from rlsync.coordinator.liveness import ALIVE, Evidence, judge, lateness
from rlsync.coordinator.registry import Registry
from rlsync.coordinator.v1 import coordinator_pb2 as pb

LEASE = 3.0


def test_a_member_that_shows_progress_is_alive_however_late_its_heartbeat():
    e = Evidence(progress_at=0.0, heartbeat_at=0.0)
    e.saw(2.9, "tokens")  # no heartbeat for 10 s, but tokens a moment ago
    assert judge(e, 10.0, LEASE).action == "drop"  # (nothing since 2.9: 7.1 s)
    e.saw(9.5, "tokens")
    assert judge(e, 10.0, LEASE) == ALIVE


def test_silence_is_suspect_at_half_the_lease_and_dropped_at_the_lease():
    e = Evidence(progress_at=0.0, heartbeat_at=0.0)
    assert judge(e, 1.5, LEASE) == ALIVE
    suspect = judge(e, 1.6, LEASE)
    assert (suspect.action, suspect.reason) == ("suspect", "silent") and "no heartbeat" in suspect.why
    drop = judge(e, 3.1, LEASE)
    assert (drop.action, drop.reason) == ("drop", "silent") and "no heartbeat" in drop.why and "3.1s" in drop.why


def test_heartbeats_that_show_no_progress_do_not_keep_a_member():
    e = Evidence(progress_at=0.0, heartbeat_at=0.0, counter=7)
    assert e.heartbeat(0.5, 8)  # moved: evidence
    for t in (1.0, 2.0, 3.0, 3.6):
        assert not e.heartbeat(t, 8)  # punctual, but its event loop has not turned since
    verdict = judge(e, 3.6, LEASE)
    assert (verdict.action, verdict.reason) == ("drop", "stalled") and "no progress for 3.1s" in verdict.why
    assert e.heartbeat(3.7, 9) and judge(e, 3.7, LEASE) == ALIVE


def test_a_member_that_computes_with_its_event_loop_held_up_is_alive():
    """Its counter stands still (a step keeps the GIL) but its CPU time grows: a third of a core here."""
    e = Evidence(progress_at=0.0, heartbeat_at=0.0, counter=7)
    assert e.heartbeat(0.3, 8, cpu=5.0)  # the counter moved: the CPU baseline
    for t in (0.6, 0.9, 1.2, 2.0, 3.0, 4.0, 15.0):
        assert e.heartbeat(t, 8, cpu=5.0 + 0.33 * (t - 0.3)), t
        assert e.kind == "cpu" and judge(e, t, LEASE) == ALIVE
    # CPU time alone keeps it CPU_ALONE leases at most: one thread that spins while the loop is stuck
    e.heartbeat(16.0, 8, cpu=5.0 + 0.33 * 15.7)
    suspect = judge(e, 16.0, LEASE)
    assert (suspect.action, suspect.reason) == ("suspect", "stalled") and "not turned for 15.7s" in suspect.why
    e.heartbeat(30.5, 8, cpu=5.0 + 0.33 * 30.2)
    assert judge(e, 30.5, LEASE).action == "drop" and CPU_ALONE * LEASE < 30.5 - 0.3
    assert e.heartbeat(30.6, 9, cpu=15.0) and judge(e, 30.6, LEASE) == ALIVE  # its loop turned


def test_a_trickle_of_cpu_is_not_progress_and_other_evidence_moves_the_baseline():
    """Background threads of a stuck process use a little CPU: under BUSY_SHARE of the time since the last
    evidence, it is dropped at the lease, stalled. Tokens seen reset what CPU time counts from."""
    e = Evidence(progress_at=0.0, heartbeat_at=0.0, counter=8)
    e.heartbeat(0.1, 8, cpu=5.0)  # the baseline
    for t in (0.4, 1.0, 2.0, 3.0, 3.2):
        assert not e.heartbeat(t, 8, cpu=5.0 + 0.01 * t), t  # 1 % of a core
    assert (judge(e, 3.2, LEASE).action, judge(e, 3.2, LEASE).reason) == ("drop", "stalled")
    e = Evidence(progress_at=0.0, heartbeat_at=0.0, counter=8)
    e.heartbeat(0.1, 8, cpu=5.0)
    assert e.heartbeat(1.0, 8, cpu=6.0)  # busy ...
    e.saw(1.1, "tokens")  # ... then tokens, then it hangs: the second of CPU it used before does not keep it
    assert not e.heartbeat(4.0, 8, cpu=6.02) and judge(e, 4.2, LEASE).action == "drop"


def test_a_member_whose_beacon_started_again_is_kept_by_its_cpu_time_from_the_new_beacons_first_report():
    """A beacon's CPU time counts the time its member waited for a CPU since that beacon started (Watched): one
    started again reports less than the last did. Its reports are then the baseline, and CPU time that grows
    from there keeps a member that computes."""
    e = Evidence(progress_at=0.0, heartbeat_at=0.0, counter=7)
    assert e.heartbeat(0.3, 8, cpu=20.0)  # the old beacon: 12 s run, 8 s waited for a CPU
    assert not e.heartbeat(0.6, 8, cpu=12.1)  # the new one: 12.1 s run, nothing waited yet
    for t in (1.0, 2.0, 3.0, 4.0):
        assert e.heartbeat(t, 8, cpu=12.1 + 0.5 * (t - 0.6)), t  # half a core: it computes
        assert judge(e, t, LEASE) == ALIVE


def test_a_member_that_reports_no_counter_is_kept_by_its_heartbeats_as_before():
    e = Evidence(progress_at=0.0, heartbeat_at=0.0)
    assert all(e.heartbeat(t, 0) for t in (1.0, 2.0, 3.0))
    assert judge(e, 3.5, LEASE) == ALIVE


def test_time_the_coordinator_stood_still_is_credited_to_every_member():
    assert lateness(now=10.0, last=9.0, tick=1.0) == 0.0  # on time
    assert lateness(now=10.0, last=8.5, tick=1.0) == 0.5  # a loop behind: what members sent waited unread
    assert lateness(now=20.0, last=2.0, tick=1.0) == 17.0  # stopped for 17 s
    e = Evidence(progress_at=1.5, heartbeat_at=1.5)
    e.credit(17.0, 20.0)
    assert judge(e, 20.0, LEASE) == ALIVE and e.progress_at == 18.5
    e.credit(100.0, 20.0)
    assert e.progress_at == 20.0  # never in the future


@pytest.fixture
def registry():
    async def make():
        return Registry("", LEASE)
    loop = asyncio.new_event_loop()
    yield loop, loop.run_until_complete(make())
    loop.close()


def test_the_registry_suspects_clears_on_evidence_and_drops_with_the_reason(registry):
    loop, reg = registry

    async def run():
        r0 = reg.add(pb.ROLE_ROLLOUT, "127.0.0.1:1", "r0")
        r0.state = "ready"
        t0 = r0.evidence.progress_at
        reg.judge(r0, t0 + 2.0)
        assert r0.suspect and "no heartbeat" in r0.suspect and r0.state == "ready"
        reg.saw(r0, "tokens")  # a chunk it streamed: back in rotation
        assert r0.suspect == "" and reg.changed.is_set()
        reg.judge(r0, r0.evidence.progress_at + 2.0)
        assert r0.suspect
        reg.judge(r0, r0.evidence.progress_at + LEASE + 0.1)
        assert r0.state == "gone" and r0.id not in reg.members and r0.gone.done()
        assert "r0 left the fleet: no heartbeat nor any other sign of progress" in r0.gone.result()
        for task in list(reg._background):
            task.cancel()

    loop.run_until_complete(run())
