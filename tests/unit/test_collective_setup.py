"""A collective's setup (store connect, group rendezvous) that fails because its peer went away is
UNAVAILABLE, naming what was being done: never an unmapped torch error (INTERNAL). A member lets go
of a group without waiting for the others."""

import pytest
import torch.distributed as dist

from rlsync.errors import Unavailable
from rlsync.transfer.backends.collective import _bounded
from rlsync.transfer.backends.groups import leave
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


class _Group:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def abort(self):
        self.calls.append("abort")
        if self.fail:
            raise RuntimeError("already broken")

    def shutdown(self):
        self.calls.append("shutdown")
        if self.fail:
            raise RuntimeError("already broken")


class ProcessGroupNCCL(_Group):  # named as torch names it: leave() tells the backends apart by the type's name
    pass


class ProcessGroupGloo(_Group):
    pass


def test_a_member_leaves_nccl_by_abort_and_gloo_by_shutdown_and_a_broken_group_raises_nothing():
    """NCCL's graceful end (ncclCommDestroy) waits for every member on the host to end the communicator
    too, which members holding it for the next transfer never do: its end is an abort, local. gloo's is
    a shutdown, the one thing that closes its connections (and fails peers still waiting at once)."""
    nccl, gloo = ProcessGroupNCCL(), ProcessGroupGloo()
    leave(nccl), leave(gloo)
    assert nccl.calls == ["abort"] and gloo.calls == ["shutdown"]
    broken = ProcessGroupNCCL(fail=True)
    leave(broken)
    assert broken.calls == ["abort"]
