"""rlsync.transfer: moves named tensors between processes out of band, over a channel chosen by
handshake (cuda_ipc, nccl, shm, gloo). Manifests and handshakes are protobuf; nothing is pickled.

    sender = WeightSender(tensors)                       # trainer side
    offer = sender.offer(version=7)
    ans = answer(offer, "replica-0", device="cpu")       # receiver side: picks the channel
    receive(offer, ans, dest)                            # ... in the receiver process
    sender.send(offer, [ans])                            # ... in the sender process
"""

import importlib

# Loaded on first use, so that importing the protobuf messages under rlsync.transfer.v1 (every
# service's and client's stubs do) does not import torch: a coordinator or a CLI never needs it.
_WHERE = {"audit": "checksum", "audit_entry": "checksum", "checksum_tensor": "checksum",
          "checksum_tensors": "checksum", "local_facts": "handshake", "Spec": "manifest",
          "build_manifest": "manifest", "check_against": "manifest", "from_proto": "manifest",
          "SharedArena": "memory", "Bucket": "plan", "Slice": "plan", "plan_buckets": "plan",
          "Receiver": "receiver", "answer": "receiver", "receive": "receiver",
          "DEFAULT_BUCKET_BYTES": "sender", "Report": "sender", "WeightSender": "sender"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rlsync.transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rlsync.transfer.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
