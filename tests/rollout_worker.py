"""A rollout replica started by a test (Services.start(..., script=)), with a fault injected first.
RLSYNC_FAULT=die_after_broadcasts:N makes it die (no cleanup) at its (N+1)th collective broadcast:
in the middle of receiving an update over gloo or NCCL, whatever its peers do.
RLSYNC_FAULT=die_after_receives:N makes it die the same way at its (N+1)th routed receive (a bucket
from a sharded trainer's rank).
RLSYNC_FAULT=corrupt_base_at:N flips a byte of the base the Nth bucket it receives as a delta is
rebuilt on, as if the weights it holds had gone bad.
RLSYNC_FAULT=die_in_prepare:N makes it die the same way right after its (N+1)th PrepareUpdate received
the bytes (a pull lands them before it answers), before it answers: any engine, any channel."""

import os
import runpy
import sys

fault = os.environ.get("RLSYNC_FAULT", "")


class _Dying:
    """A process group whose `method` kills this process (no cleanup) once called more than `limit` times."""

    def __init__(self, group, method: str, limit: int, count: dict):
        self._group, self._method, self._limit, self._count = group, method, limit, count

    def __getattr__(self, name):
        attr = getattr(self._group, name)
        if name != self._method:
            return attr

        def dying(*args, **kwargs):
            self._count["n"] += 1
            if self._count["n"] > self._limit:
                os._exit(9)
            return attr(*args, **kwargs)
        return dying


if fault.startswith("die_after_broadcasts:"):
    from rlsync.transfer.backends import collective

    limit, count = int(fault.split(":")[1]), {"n": 0}
    real = collective._Broadcast._join

    def _join(self, job):
        session = real(self, job)
        if not isinstance(session.group, _Dying):
            session.group = _Dying(session.group, "broadcast", limit, count)
        return session

    collective._Broadcast._join = _join

if fault.startswith("die_after_receives:"):
    from rlsync.transfer import routed

    limit, count = int(fault.split(":")[1]), {"n": 0}
    real_receive = routed.receive
    routed.receive = lambda pg, *args, **kwargs: real_receive(_Dying(pg, "recv", limit, count), *args, **kwargs)

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

if fault.startswith("die_in_prepare:"):
    from rlsync.rollout import core

    limit, count = int(fault.split(":")[1]), {"n": 0}
    real_prepare = core.RolloutCore.prepare_update

    async def _prepare(self, *args, **kwargs):
        answer = await real_prepare(self, *args, **kwargs)
        count["n"] += 1
        if count["n"] > limit:
            os._exit(9)
        return answer

    core.RolloutCore.prepare_update = _prepare

sys.argv = ["rlsync.rollout", *sys.argv[1:]]
runpy.run_module("rlsync.rollout", run_name="__main__", alter_sys=True)
