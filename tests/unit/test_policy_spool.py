"""A CPU trainer's offload folder: one it made for itself goes with it (every trainer a test session started
used to leave an empty rlsync-spool-* folder in /tmp); one it was given stays."""

from __future__ import annotations

import gc

from rlsync.models import ensure_tiny_model
from rlsync.trainer.policy import Policy


def _policy(spool_dir: str) -> Policy:
    return Policy(str(ensure_tiny_model()), "cpu", "float32", 1e-3, 0.0, spool_dir)


def test_a_spool_folder_of_its_own_making_goes_with_the_policy_and_a_given_one_stays(tmp_path):
    policy = _policy("")
    made = policy.spool
    assert made.is_dir() and made.name.startswith("rlsync-spool-")
    del policy
    gc.collect()
    assert not made.exists()

    given = tmp_path / "spool"
    policy = _policy(str(given))
    del policy
    gc.collect()
    assert given.is_dir()
