"""rlsync.transfer: moves named tensors between processes out of band, over a channel chosen by
handshake (cuda_ipc, nccl, shm, gloo). Manifests and handshakes are protobuf; nothing is pickled.

    sender = WeightSender(tensors)                       # trainer side
    offer = sender.offer(version=7)
    ans = answer(offer, "replica-0", device="cpu")       # receiver side: picks the channel
    receive(offer, ans, dest)                            # ... in the receiver process
    sender.send(offer, [ans])                            # ... in the sender process
"""

from rlsync.transfer.checksum import audit_entry, checksum_tensor
from rlsync.transfer.handshake import local_facts
from rlsync.transfer.manifest import Spec, build_manifest, check_against, from_proto
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.plan import Bucket, Slice, plan_buckets
from rlsync.transfer.receiver import Receiver, answer, receive
from rlsync.transfer.sender import DEFAULT_BUCKET_BYTES, Report, WeightSender

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "Receiver", "Report", "SharedArena", "Slice", "Spec", "WeightSender",
           "answer", "audit_entry", "build_manifest", "check_against", "checksum_tensor", "from_proto", "local_facts",
           "plan_buckets", "receive"]
