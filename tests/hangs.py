"""What the tests of hung and cut-off members share: a short lease, what "promptly" means, a transfer
slow enough to stop a member in the middle of, and the steps they take around it."""

from __future__ import annotations

import concurrent.futures
import time

from rlsync.client import RolloutClient, trajectory

LEASE = 2.5
FAST = ["--lease", str(LEASE), "--heartbeat-interval", "0.3"]
MOVE_ON = LEASE + 10  # what "promptly" means on two busy cores: the lease, its check, and a margin


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


def report(what: str, seconds: float, also: float = 0.0) -> None:
    """also: what the fleet does after moving on that counts here (a transfer made slow on purpose)."""
    print(f"\n[hung] {what}: moved on in {seconds:.1f}s (lease {LEASE}s)")
    assert seconds < MOVE_ON + also, f"{what}: took {seconds:.1f}s, more than the lease ({LEASE}s) + 10s"


# A slow transfer to stop a member in the middle of: ~90 MB in 16 KiB buckets over gloo.
SLOW = {"trainer_extra": ("--bucket-bytes", "16384"), "co_extra": ("--force-backend", "gloo")}
