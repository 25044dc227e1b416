"""Imported by a peer process (`--inject fault_injection`) to inject the fault RLSYNC_FAULT names:

- `bad_checksum`: the sender announces a wrong checksum for its second bucket, as if the bytes
  had been damaged in flight;
- `die_after:N`: the process dies (SIGKILL-like, no cleanup) once N tensors have arrived.
"""

import os

from rlsync.transfer import writer
from rlsync.transfer.backends import collective, slots

fault = os.environ.get("RLSYNC_FAULT", "")

if fault == "bad_checksum":
    _calls = {"n": 0}
    _real = slots.checksum_bytes

    def _lie(value: str) -> str:
        return value[:-1] + ("0" if value[-1] != "0" else "1")

    def _lying_checksum(data):
        _calls["n"] += 1
        value = _real(data)
        return _lie(value) if _calls["n"] == 2 else value

    class _LyingChecksums(collective.Checksums):
        def values(self):
            values = super().values()
            return [_lie(v) if i == 1 else v for i, v in enumerate(values)]

    slots.checksum_bytes = _lying_checksum
    collective.Checksums = _LyingChecksums

elif fault.startswith("die_after:"):
    _limit = int(fault.split(":")[1])
    _real_mark_many = writer.DestWriter.mark_many

    def _mark_then_maybe_die(self, marks):
        _real_mark_many(self, marks)
        if sum(got == spec.nbytes for got, spec in zip(self.received, self.specs)) >= _limit:
            os._exit(9)

    writer.DestWriter.mark_many = _mark_then_maybe_die
