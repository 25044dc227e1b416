"""Receives run on daemon threads kept between updates: a job goes to an idle worker without starting
a thread, and a job that never returns (a hung receive) keeps its thread while the next one runs."""

from __future__ import annotations

import threading
import time

from rlsync.rollout.staging import _Workers


def _run(workers: _Workers, job) -> threading.Event:
    done = threading.Event()

    def wrapped():
        job()
        done.set()

    workers.run(wrapped)
    return done


def _until(holds, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not holds():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_job_after_the_last_one_ended_runs_on_the_same_thread():
    workers, ran_on = _Workers(), []
    for _ in range(3):
        assert _run(workers, lambda: ran_on.append(threading.get_ident())).wait(5)
        _until(lambda: workers._idle == 1)  # the worker counts itself idle once its job returned
    assert len(set(ran_on)) == 1
    assert threading.get_ident() not in ran_on


def test_a_hung_job_keeps_its_thread_and_the_next_job_runs_beside_it():
    workers, release = _Workers(), threading.Event()
    hung = _run(workers, lambda: release.wait(10))
    assert _run(workers, lambda: None).wait(5)  # not queued behind the hung one
    assert not hung.is_set()
    release.set()
    assert hung.wait(5)
