"""What the tests of hung and cut-off members share: a short lease, what "promptly" means, a transfer
slow enough to stop a member in the middle of, and the steps they take around it."""

from __future__ import annotations

import concurrent.futures
import time

from rlsync.client import RolloutClient, trajectory

LEASE = 2.5
FAST = ["--lease", str(LEASE), "--heartbeat-interval", "0.3"]
# What "promptly" means: the lease, its check and a survivor's AbortUpdate (5 s when its gloo receive
# is stuck), with room for a busy CI machine; a fleet without the lease would wait for the update's
# deadline (the coordinator's --update-timeout, 300 s here).
MOVE_ON = LEASE + 20


def train(client, seed=0):
    done = client.complete("3+4=", n=4, max_tokens=8, temperature=1.0, logprobs=True, seed=seed)
    client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])


def in_background(fn, *args):
    return concurrent.futures.ThreadPoolExecutor(1).submit(fn, *args)


def wait_prepared(replicas: list[RolloutClient], timeout=60.0) -> None:
    """Until every replica holds a prepared update: the transfer into them is about to run or runs."""
    deadline = time.monotonic() + timeout
    while not all(r.info().pending_version >= 0 for r in replicas):
        assert time.monotonic() < deadline, "the replicas never prepared the update"
        time.sleep(0.01)


def report(what: str, seconds: float, retry=None, tag: str = "hung") -> None:
    """retry: the SyncResult of a sync the fleet ran again without the lost member; its own steps
    (a transfer made slow on purpose, as long as the load on the machine makes it) come after moving
    on and are not counted."""
    again = sum(retry.phases.values()) if retry is not None else 0.0
    print(f"\n[{tag}] {what}: moved on in {seconds - again:.1f}s (lease {LEASE}s)"
          + (f", then the sync again without it in {again:.1f}s {dict(retry.phases)}" if retry is not None else ""))
    assert seconds - again < MOVE_ON, f"{what}: took {seconds - again:.1f}s, more than the lease ({LEASE}s) + 20s"


# A slow transfer to stop a member in the middle of: ~90 MB in 16 KiB buckets over gloo.
SLOW = {"trainer_extra": ("--bucket-bytes", "16384"), "co_extra": ("--force-backend", "gloo")}
