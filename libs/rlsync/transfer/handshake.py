"""The handshake, pure: the sender offers backends and facts, the receiver picks a channel by topology.

Same GPU -> cuda_ipc; GPUs elsewhere -> nccl; same host -> shm; anywhere -> gloo. A forced
backend is honoured when it can work, and refused with the reason when it cannot.

Receivers on another GPU of the sender's host may map the sender's memory too (cuda_ipc over P2P):
those the offer names (Offer.peer_readers), when their GPU reads the sender's (Facts.peer_uuids, from
NVML). A copy engine's peer copy beats NCCL's broadcast into one GPU (H200 NVLink: 395 against 369
GB/s, and it takes no SM from decoding), but readers on several GPUs share the sender GPU's links,
where a broadcast gives each the whole link: the sender names readers on one GPU only.
"""

from __future__ import annotations

import logging
import os
import socket
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from rlsync.errors import FailedPrecondition
from rlsync.transfer.v1 import transfer_pb2 as pb

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # torch is loaded by the facts of a device only: the coordinator never needs it
    import torch

# 2: a pull may cast (MappedTensors.dtype); a receiver of 1 would copy the sender's bytes as they are
# 3: a routed receiver rank waits for the roster on a wake key of its own (transfer.sharded); with a sender of 2
#    it would wait until its deadline
# 4: a broadcast transfer starts with a token of its id (transfer.backends.groups), and each end may post its
#    half ahead; a receiver of 3 would take the token for its first bucket
# 5: a routed offer names the trainer's layout by digest (Routing.layout), kept in the trainer's store; a
#    receiver of 4 would find no layout in it
PROTOCOL_VERSION = 5
B = pb.Backend
NAMES = {B.BACKEND_CUDA_IPC: "cuda_ipc", B.BACKEND_NCCL: "nccl", B.BACKEND_SHM: "shm", B.BACKEND_GLOO: "gloo"}
BY_NAME = {v: k for k, v in NAMES.items()}
PREFERENCE = [B.BACKEND_CUDA_IPC, B.BACKEND_NCCL, B.BACKEND_SHM, B.BACKEND_GLOO]


def backend_of(name: str) -> int:
    try:
        return BY_NAME[name]
    except KeyError:
        raise FailedPrecondition(f"unknown backend {name!r}: choose one of {', '.join(BY_NAME)}") from None


@cache
def host_id() -> str:
    """Equal for processes that can share memory and reach each other's abstract Unix sockets:
    same kernel boot and same network namespace (two containers on one host differ). A launcher
    that knows the node a process runs on (`rlsync up` on Ray) says so in RLSYNC_NODE_ID: two
    Ray nodes are two hosts."""
    if node := os.environ.get("RLSYNC_NODE_ID"):
        return node
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        return f"{boot}/{netns}"
    except OSError:  # not Linux: fall back to the hostname
        return socket.gethostname()


def local_facts(device: torch.device | str = "cpu") -> pb.Facts:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return pb.Facts(host_id=host_id(), device_type=device.type, hostname=socket.gethostname())
    uuid = gpu_uuid(device)
    return pb.Facts(host_id=host_id(), device_type="cuda", gpu_uuids=[uuid], hostname=socket.gethostname(),
                    peer_uuids=_peer_uuids(uuid))


@cache
def gpu_uuid(device: torch.device) -> str:
    """The UUID of `device`, as Facts.gpu_uuids name it."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


_P2P_READ = 0  # NVML_P2P_CAPS_INDEX_READ, which pynvml spells as the tuple (0,)


@cache
def _peer_uuids(uuid: str) -> tuple[str, ...]:
    """The other GPUs of this host that GPU `uuid` reads by P2P, as NVML sees them (all the host's GPUs,
    whatever CUDA_VISIBLE_DEVICES says: a mapping by IPC handle does not need the sender's GPU
    visible). () without NVML (nvidia-ml-py: `pip install rlsync[gpu]`), on a MIG instance, or with
    RLSYNC_PEER_PULLS=0. Asked once per process and GPU (the first offer or prepare on it)."""
    if os.environ.get("RLSYNC_PEER_PULLS", "1") == "0":
        return ()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no NVML: no peer pulls, NCCL between GPUs as before
        log.info("no pulls from other GPUs (cuda_ipc over P2P): no NVML (%s); they take NCCL", e)
        return ()
    try:
        mine = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        peers = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                other = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = _text(pynvml.nvmlDeviceGetUUID(other)).removeprefix("GPU-")
                if name != uuid and pynvml.nvmlDeviceGetP2PStatus(mine, other, _P2P_READ) == pynvml.NVML_P2P_STATUS_OK:
                    peers.append(name)
            except pynvml.NVMLError:  # a GPU NVML cannot ask about (MIG enabled, fallen off the bus): no peer
                continue
        return tuple(peers)
    except Exception as e:  # noqa: BLE001 - a MIG instance's UUID, say (no P2P), or an NVML without the call
        log.info("no pulls from other GPUs (cuda_ipc over P2P): NVML cannot say which GPUs GPU-%s reads (%s)", uuid, e)
        return ()
    finally:
        pynvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def same_gpu(facts: pb.Facts, device: torch.device | str) -> str | None:
    """None when memory `facts` describe lies on `device`'s GPU (cuda_ipc can map it), else why not."""
    return _feasible(B.BACKEND_CUDA_IPC, facts, local_facts(device))


def peer_gpu(facts: pb.Facts, device: torch.device | str) -> str | None:
    """None when memory `facts` describe lies on a GPU that `device`'s reads by P2P, else why not."""
    return _feasible(B.BACKEND_CUDA_IPC, facts, local_facts(device), peer=True)


def _feasible(backend: int, sender: pb.Facts, receiver: pb.Facts, peer: bool = False) -> str | None:
    """None when `backend` can connect these two parties, else why not. peer: cuda_ipc may map the
    sender's memory on a GPU the receiver's reads by P2P (the offer names it a peer reader)."""
    same_host = sender.host_id == receiver.host_id
    both_cuda = sender.device_type == "cuda" and receiver.device_type == "cuda"
    if backend == B.BACKEND_CUDA_IPC:
        if not both_cuda:
            return "cuda_ipc needs CUDA tensors on both sides"
        if not same_host:
            return "cuda_ipc needs both processes on the same host"
        reach = set(receiver.gpu_uuids) | (set(receiver.peer_uuids) if peer else set())
        if not set(sender.gpu_uuids) & reach:
            why = (f"cuda_ipc needs the same GPU: sender on {', '.join(sender.gpu_uuids)}, "
                   f"receiver on {', '.join(receiver.gpu_uuids)}")
            if peer:
                return why + " (or one it reads by P2P, which it does not)"
            return why
    elif backend == B.BACKEND_NCCL:
        if not both_cuda:
            return "nccl needs CUDA tensors on both sides"
        if same_host and set(sender.gpu_uuids) & set(receiver.gpu_uuids):
            return f"nccl takes no two ranks on one GPU (both on {', '.join(receiver.gpu_uuids)})"
    elif backend == B.BACKEND_SHM:
        if not same_host:
            return (f"shm needs both processes on one host (sender on {sender.hostname}, "
                    f"receiver on {receiver.hostname})")
    return None


def _reason(backend: int, sender: pb.Facts, receiver: pb.Facts) -> str:
    if backend == B.BACKEND_CUDA_IPC and not set(sender.gpu_uuids) & set(receiver.gpu_uuids):
        return (f"a peer GPU ({', '.join(sender.gpu_uuids)}, read by P2P from {', '.join(receiver.gpu_uuids)}): "
                "receiver maps the sender's memory, named by the sender as a peer reader")
    return {
        B.BACKEND_CUDA_IPC: f"same GPU ({', '.join(receiver.gpu_uuids)}): receiver maps the sender's memory",
        B.BACKEND_NCCL: "GPUs on both sides, not the same GPU: NCCL broadcast",
        B.BACKEND_SHM: "same host: shared memory",
        B.BACKEND_GLOO: f"different hosts ({sender.hostname} -> {receiver.hostname}): gloo over TCP",
    }[backend]


def choose_backend(offer: pb.Offer, receiver: pb.Facts, available: set[int] | None = None,
                   force: int | None = None, receiver_id: str = "") -> tuple[int, str]:
    """(backend, why) for this receiver; raises FailedPrecondition saying what to change."""
    peer = bool(receiver_id) and receiver_id in offer.peer_readers
    if offer.protocol_version != PROTOCOL_VERSION:
        raise FailedPrecondition(f"transfer protocol mismatch: sender speaks version {offer.protocol_version}, "
                                 f"this receiver {PROTOCOL_VERSION}; run the same rlsync release on both sides")
    offered = set(offer.backends)
    available = set(PREFERENCE) if available is None else available
    if force:
        name = NAMES.get(force, str(force))
        if force not in offered:
            raise FailedPrecondition(f"backend {name} was forced but the sender offers only "
                                     f"{', '.join(NAMES[b] for b in PREFERENCE if b in offered) or 'nothing'}")
        if force not in available:
            raise FailedPrecondition(f"backend {name} was forced but is not available on this receiver")
        why_not = _feasible(force, offer.facts, receiver, peer)
        if why_not:
            raise FailedPrecondition(f"backend {name} was forced but cannot work here: {why_not}")
        return force, f"forced by the user ({name})"
    refusals = []
    for backend in PREFERENCE:
        why_not = _feasible(backend, offer.facts, receiver, peer)
        if why_not is None and backend in offered and backend in available:
            return backend, _reason(backend, offer.facts, receiver)
        refusals.append(f"{NAMES[backend]}: " + (why_not or ("not offered by the sender" if backend not in offered
                                                             else "not available on this receiver")))
    raise FailedPrecondition("no transfer backend works between sender and receiver: " + "; ".join(refusals))


def make_answer(offer: pb.Offer, receiver_id: str, facts: pb.Facts, ranks: int = 1,
                available: set[int] | None = None, force: int | None = None, bucket_bytes: int = 0,
                base_version: int | None = None) -> pb.Answer:
    backend, reason = choose_backend(offer, facts, available, force, receiver_id)
    pull = backend == B.BACKEND_CUDA_IPC and len(offer.mapped.ipc) > 0  # it maps the sender's memory itself
    delta = base_version is not None and backend in (B.BACKEND_GLOO, B.BACKEND_NCCL)  # only broadcasts take deltas
    return pb.Answer(backend=backend, receiver_id=receiver_id, ranks=ranks, reason=reason, facts=facts,
                     bucket_bytes=bucket_bytes or offer.bucket_bytes, transfer_id=offer.transfer_id, pull=pull,
                     delta=delta, base_version=base_version if delta else 0)
