"""A rollout replica started by a test (Services.start(..., script=)), with a fault injected first.
RLSYNC_FAULT=die_after_broadcasts:N makes it die (no cleanup) at its (N+1)th collective broadcast:
in the middle of receiving an update over gloo or NCCL, whatever its peers do.
RLSYNC_FAULT=die_after_receives:N makes it die the same way at its (N+1)th routed receive (a bucket
from a sharded trainer's rank).
RLSYNC_FAULT=corrupt_base_at:N flips a byte of the base the Nth bucket it receives as a delta is
rebuilt on, as if the weights it holds had gone bad."""

import os
import runpy
import sys

fault = os.environ.get("RLSYNC_FAULT", "")
if fault.startswith("die_after_broadcasts:"):
    from rlsync.transfer.backends import collective

    limit, count = int(fault.split(":")[1]), {"n": 0}

    class _Dying:
        def __init__(self, group):
            self._group = group

        def broadcast(self, *args, **kwargs):
            count["n"] += 1
            if count["n"] > limit:
                os._exit(9)
            return self._group.broadcast(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._group, name)

    real = collective._Broadcast._join

    def _join(self, job):
        session = real(self, job)
        if not isinstance(session.group, _Dying):
            session.group = _Dying(session.group)
        return session

    collective._Broadcast._join = _join

if fault.startswith("die_after_receives:"):
    from rlsync.transfer import routed

    limit, count = int(fault.split(":")[1]), {"n": 0}

    class _DyingGroup:
        def __init__(self, group):
            self._group = group

        def recv(self, *args, **kwargs):
            count["n"] += 1
            if count["n"] > limit:
                os._exit(9)
            return self._group.recv(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._group, name)

    real_receive = routed.receive
    routed.receive = lambda pg, *args, **kwargs: real_receive(_DyingGroup(pg), *args, **kwargs)

if fault.startswith("corrupt_base_at:"):
    from rlsync.transfer import delta

    at, seen = int(fault.split(":")[1]), {"n": 0}
    real_apply = delta.apply

    def _apply(payload, out):
        seen["n"] += 1
        if seen["n"] == at:
            out[0] ^= 0xFF  # the base bytes of this bucket, as this replica holds them
        return real_apply(payload, out)

    delta.apply = _apply

sys.argv = ["rlsync.rollout", *sys.argv[1:]]
runpy.run_module("rlsync.rollout", run_name="__main__", alter_sys=True)
