"""A collective's setup (store connect, group rendezvous) that fails because its peer went away is
UNAVAILABLE, naming what was being done: never an unmapped torch error (INTERNAL)."""

import pytest
import torch.distributed as dist

from rlsync.errors import Unavailable
from rlsync.transfer.backends.collective import _bounded
from rlsync.transfer.control import Deadline


def test_a_peer_lost_during_setup_is_unavailable():
    def join():
        raise dist.DistNetworkError("Connection reset by peer")

    with pytest.raises(Unavailable, match="joining the process group failed.*Connection reset by peer"):
        _bounded(join, [], Deadline(5, "test"), "joining the process group")


def test_other_setup_errors_pass_through_and_results_come_back():
    def broken():
        raise ValueError("a bug, not a peer")

    with pytest.raises(ValueError, match="a bug"):
        _bounded(broken, [], Deadline(5, "test"), "joining")
    assert _bounded(lambda: 42, [], Deadline(5, "test"), "joining") == 42
