"""The replica's side of a vLLM worker's copy armed at a wake (vllm_worker.rlsync_arm, rlsync.transfer.armed):
which offers it is, decided in the replica's own process, with no call into the engine. Pure logic.

The worker arms its last pull into the live weights again, from the storages it holds now; an offer is that
copy's when it rang the bell and names the same tensors, from the same places of exactly those storages, in the
same dtypes. The worker still checks at the commit that the bell value this offer carries started the copy."""

from __future__ import annotations

from rlsync.transfer.v1 import transfer_pb2 as pb


def unlike(offer: pb.Offer, armed: pb.Offer, held: list[bytes], force_backend: str) -> str:
    """Why `offer` is not the offer the copy armed from the pull of `armed` repeats, from the storages
    `held` (the worker's hold, in its order); "" when it is."""
    mapped, was = offer.mapped, armed.mapped
    if not (mapped.bell > 0 and mapped.waits):
        return "the sender rang no bell"
    if force_backend not in ("", "cuda_ipc"):
        return f"a backend forced ({force_backend})"
    if offer.HasField("routing") or offer.manifest.HasField("adapter"):
        return "a routed offer or an adapter"
    if list(mapped.ipc) != held:
        return "other storages than the ones held"
    if (mapped.region, mapped.offset, mapped.dtype) != (was.region, was.offset, was.dtype):
        return "other places in them"
    if offer.manifest.tensors != armed.manifest.tensors:
        return "other tensors"
    return ""


def adopted(answer: pb.Answer, transfer_id: str, receiver_id: str, event: bytes) -> pb.Answer:
    """The answer to an offer that adopts the armed copy: the armed pull's own (the same channel for the same
    tensors), for this transfer and receiver, naming the copy's event (the sender waits for it: Answer.copied)."""
    out = pb.Answer()
    out.CopyFrom(answer)
    out.ClearField("stages")
    del out.copied[:]
    out.transfer_id, out.receiver_id = transfer_id, receiver_id
    out.copied.append(event)
    return out
