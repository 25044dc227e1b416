"""A receiver or sender in its own process, driven over stdin/stdout with base64 protobuf lines.

Used by `rlsync transfer-check` and by tests that need a real second process:

    python -m rlsync.transfer.peer receive --file W.safetensors --device cpu   (stdin: offer [, answer])
    python -m rlsync.transfer.peer send --file W.safetensors --backend shm     (stdout: offer; stdin: answers)
"""

from __future__ import annotations

import argparse
import base64
import json
import sys

import torch
from safetensors.torch import load_file

from rlsync.flat import FlatStore
from rlsync.transfer.armed import Bell
from rlsync.transfer.checksum import as_bytes, checksum_tensors
from rlsync.transfer.host_bell import HostBell
from rlsync.transfer.manifest import from_proto
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.receiver import answer as make_answer
from rlsync.transfer.held import HELD
from rlsync.transfer.receiver import Receiver
from rlsync.transfer.sender import DEFAULT_BUCKET_BYTES, Report, WeightSender
from rlsync.transfer.v1 import transfer_pb2 as pb


def encode(msg) -> str:
    return base64.b64encode(msg.SerializeToString()).decode()


def decode(cls, line: str):
    msg = cls()
    msg.ParseFromString(base64.b64decode(line.strip()))
    return msg


def load_tensors(path: str, device: str, arena: SharedArena | None = None) -> dict[str, torch.Tensor]:
    tensors = load_file(path, device="cpu")
    if arena is not None:  # CPU one-copy: the tensors live in shared memory
        shared = {}
        for name, t in tensors.items():
            dst = arena.empty(t.numel(), t.dtype).view(t.shape)
            dst.copy_(t)
            shared[name] = dst
        return shared
    return {n: t.to(device) for n, t in tensors.items()}


def emit(kind: str, payload: str) -> None:
    print(f"{kind} {payload}", flush=True)


def run_receive(args) -> int:
    """Receives one offer per stdin line (--loop: until stdin closes) into the same destination.
    --arm [host] (with --hold): after each pull from held storages, the same pull is armed behind this
    process's bell (host: a HostBell; its handle first, as a BELL line; an ARMED line after each RESULT once
    armed); an offer rung with a bell value adopts it."""
    dest = None
    status = 0
    bell = (HostBell if args.arm == "host" else Bell)(torch.device(args.device)) if args.arm else None
    if bell is not None:
        emit("BELL", bell.handle.hex())
    armed, last = None, None  # the copy armed for the next offer, and the receiver whose pull it repeats
    for line in sys.stdin:
        offer = decode(pb.Offer, line)
        if args.rank == 0:
            ans = make_answer(offer, args.receiver_id, device=args.device, ranks=args.ranks, force=args.backend,
                              bucket_bytes=args.bucket_bytes)
        else:
            ans = decode(pb.Answer, sys.stdin.readline())
        if dest is None:
            dest = flat_destination(offer.manifest, args.device)
        try:
            adopted = armed is not None and ans.pull and armed.adopt(from_proto(offer.manifest), offer)
            if adopted:  # the sender started it on the GPU: wait for it as the sender does, on its event
                ans.copied.append(bell.event_handle)
                emit("ANSWER", encode(ans))
                bell.event.synchronize()
                report = Report(armed.nbytes, 0.0, {"cuda_ipc": 1})
            else:
                if armed is not None:
                    armed.disarm()
                last = Receiver(offer, ans, dest, rank=args.rank, timeout=args.timeout,  # ready before answering
                                hold=args.hold)
                report = last.run() if ans.pull else None  # a pull is done before its answer goes back
                if args.rank == 0:
                    emit("ANSWER", encode(ans))
                report = report or last.run()
        except Exception as e:  # noqa: BLE001 - reported to the driver as data
            emit("RESULT", json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
            status = 1
            if not args.loop:
                break
            continue
        verified = None
        if args.file:
            reference = load_file(args.file, device="cpu")
            verified = all(torch.equal(as_bytes(dest.views[n].cpu()), as_bytes(t)) for n, t in reference.items())
        emit("RESULT", json.dumps({"ok": True, "bytes": report.nbytes, "seconds": report.seconds,
                                   "verified": verified, "stages": report.profile, "adopted": adopted,
                                   "adopted_posted": bool(last is not None and last.adopted_posted),
                                   **({"checksums": dict(zip(dest.views, checksum_tensors(list(dest.views.values()))))}
                                      if args.report_checksums else {})}))
        armed = last.arm(bell) if bell is not None and last is not None else None  # after the checksums' kernels
        if bell is not None:
            emit("ARMED", json.dumps(armed is not None))  # a sender that rings now starts it (none: no copy armed)
        if not args.loop:
            break
    if armed is not None:
        armed.disarm()  # it reads the sender's memory: done before the mappings close
    if args.hold:
        HELD.release(args.hold)  # before the sender's memory may go (it waits for this process to exit)
    return status


def run_send(args) -> int:
    arena = SharedArena() if args.device == "cpu" and not args.staged else None
    tensors = load_tensors(args.file, args.device, arena)
    with WeightSender(tensors, bucket_bytes=args.bucket_bytes or DEFAULT_BUCKET_BYTES, checksums=args.checksums,
                      arena=arena, backends=[args.backend] if args.backend else None) as sender:
        offer = sender.offer(version=args.version)
        emit("OFFER", encode(offer))
        answers = [decode(pb.Answer, line) for line in sys.stdin.readline().split()]
        try:
            report = sender.send(offer, answers, timeout=args.timeout)
        except Exception as e:  # noqa: BLE001
            emit("RESULT", json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
            return 1
    emit("RESULT", json.dumps({"ok": True, "bytes": report.nbytes, "seconds": report.seconds}))
    return 0


def flat_destination(manifest: pb.Manifest, device: str) -> FlatStore:
    """The manifest's tensors in one buffer per dtype, as an engine keeps its weights."""
    return FlatStore({s.name: (torch.Size(s.shape), s.dtype) for s in from_proto(manifest)}, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("send", "receive"))
    parser.add_argument("--file", default="")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--bucket-bytes", type=int, default=0)
    parser.add_argument("--receiver-id", default="peer")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--checksums", action="store_true")
    parser.add_argument("--loop", action="store_true", help="receiver: one transfer per offer line until EOF")
    parser.add_argument("--hold", default="", help="receiver (cuda_ipc one-copy): keep the sender's storages mapped "
                                                   "from one transfer to the next under this holder name")
    parser.add_argument("--arm", nargs="?", const="device", choices=("device", "host"),
                        help="receiver (with --hold): arm each held pull again for the next offer, behind a bell "
                             "(BELL line: its handle) in GPU memory, or (host) in pinned host memory")
    parser.add_argument("--report-checksums", action="store_true", help="receiver: each RESULT gives the checksum "
                                                                        "of every tensor received")
    parser.add_argument("--staged", action="store_true", help="sender: no one-copy even when possible")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--inject", default="", help="tests only: a module imported first (fault injection)")
    args = parser.parse_args(argv)
    if args.inject:
        __import__(args.inject)
    return run_send(args) if args.role == "send" else run_receive(args)


if __name__ == "__main__":
    sys.exit(main())
