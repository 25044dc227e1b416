"""The rank-0 request queue of rlsync.publish, on one rank: every request gets an answer, whatever
happened to its caller or to the work before it ran."""

from __future__ import annotations

import concurrent.futures

import pytest

from rlsync.publish.ranks import PublishPoints, Ranks


def points() -> PublishPoints:
    return PublishPoints(Ranks(), lambda: object())


def finished() -> concurrent.futures.Future:
    f = concurrent.futures.Future()
    f.set_result(None)
    return f


def test_a_request_its_caller_gave_up_on_is_skipped_and_the_next_one_runs():
    p, ran = points(), []
    gone = p.submit(lambda: ran.append("gone"))
    gone.cancel()
    kept = p.submit(lambda: ran.append("kept") or 7)
    p.serve_until(finished())
    assert ran == ["kept"] and kept.result() == 7


def test_a_failure_before_the_work_runs_is_the_requests_answer_and_serving_goes_on():
    p = points()

    def no_passes():
        raise RuntimeError("the model is on two devices")

    bad = p.submit(lambda: "never", passes=no_passes)
    good = p.submit(lambda: "ok")
    p.serve_until(finished())
    with pytest.raises(RuntimeError, match="two devices"):
        bad.result()
    assert good.result() == "ok"


def test_requests_queued_when_the_sync_fails_are_answered_before_the_error_is_raised():
    p = points()
    failed = concurrent.futures.Future()
    failed.set_exception(ConnectionError("coordinator gone"))
    queued = p.submit(lambda: "served")
    with pytest.raises(ConnectionError):
        p.serve_until(failed)
    assert queued.result(timeout=1) == "served"
