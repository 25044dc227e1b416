"""The window of a routed transfer on a GPU polls each operation's completion (NCCL's timed wait sleeps a
millisecond or more at a time): pure logic, with stand-in works. A work that never completes fails
the transfer at its deadline; one that failed fails it as a gone peer; each completion runs once its
work is done, in order."""

import time

import pytest
import torch

from rlsync.errors import DeadlineExceeded, Unavailable
from rlsync.transfer.control import Deadline
from rlsync.transfer.routed import WINDOW, _Window


class Work:
    def __init__(self, done_after: int = 0, error: str = ""):
        self.looks, self.done_after, self.error, self.waited = 0, done_after, error, False

    def is_completed(self) -> bool:
        self.looks += 1
        return self.looks > self.done_after

    def wait(self, timeout=None) -> bool:
        assert timeout is None, "a GPU operation is never waited for with NCCL's timed wait"
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)
        return True


GPU = torch.device("cuda", 0)  # only its type is looked at


def test_completions_run_in_order_once_their_work_is_done_and_the_window_stays_bounded():
    order = []
    works = [Work(done_after=3) for _ in range(5)]
    with _Window(Deadline(5, "test"), GPU) as window:
        for i, w in enumerate(works):
            window.reserve()
            assert len(window.pending) < WINDOW
            window.add([w], lambda i=i: order.append(i))
        window.drain()
    assert order == [0, 1, 2, 3, 4]
    assert all(w.waited and w.looks == 4 for w in works), "polled until done, then its stream wait"
    profile = {}
    window.profile(profile)
    assert set(profile) == {"wait", "land"}


def test_a_work_that_never_completes_fails_the_transfer_at_its_deadline():
    with _Window(Deadline(0.2, "routed transfer t"), GPU) as window:
        window.add([Work(done_after=10**9)])
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="did not take part in time"):
            window.drain()
    assert time.monotonic() - start < 5


def test_a_failed_work_fails_the_transfer_as_a_gone_peer():
    with _Window(Deadline(5, "routed transfer t"), GPU) as window:
        window.add([Work(error="NCCL error: remote process exited")])
        with pytest.raises(Unavailable, match="a peer failed or is gone"):
            window.drain()
