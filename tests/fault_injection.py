"""Imported by a peer process (`--inject fault_injection`) to corrupt what it sends: the sender
announces a wrong checksum for its second bucket, as if the bytes had been damaged in flight."""

from rlsync.transfer.backends import collective, slots

_calls = {"n": 0}
_real = slots.checksum_bytes


def _lying_checksum(data):
    _calls["n"] += 1
    value = _real(data)
    return value[:-1] + ("0" if value[-1] != "0" else "1") if _calls["n"] == 2 else value


slots.checksum_bytes = _lying_checksum
collective.checksum_bytes = _lying_checksum
