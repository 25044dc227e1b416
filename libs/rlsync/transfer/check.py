"""`rlsync transfer-check`: move every tensor of a safetensors file to another process over one
backend, verify it bit for bit there, and print one JSON line. Exit status 1 when not verified."""

from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys

from rlsync.transfer.peer import decode, encode, load_tensors
from rlsync.transfer.memory import SharedArena
from rlsync.transfer.sender import DEFAULT_BUCKET_BYTES, WeightSender
from rlsync.transfer.v1 import transfer_pb2 as pb


def _line(proc: subprocess.Popen, kind: str) -> str:
    for raw in proc.stdout:
        if raw.startswith(kind + " "):
            return raw[len(kind) + 1:].strip()
    raise SystemExit(f"receiver exited ({proc.wait()}) before sending {kind}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlsync transfer-check", description=__doc__)
    parser.add_argument("file", help="a .safetensors file")
    parser.add_argument("--backend", required=True, choices=("shm", "gloo", "cuda_ipc", "nccl"))
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--device", default=None, help="sender device (default: cuda for cuda_ipc/nccl, else cpu)")
    parser.add_argument("--receiver-device", default=None, help="default: cuda:1 for nccl, else the sender's")
    parser.add_argument("--staged", action="store_true", help="disable the one-copy path")
    parser.add_argument("--checksums", action="store_true", help="also verify checksums in flight")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    gpu = args.backend in ("cuda_ipc", "nccl")
    device = args.device or ("cuda:0" if gpu else "cpu")
    receiver_device = args.receiver_device or ("cuda:1" if args.backend == "nccl" else device)

    if not os.path.isfile(args.file):
        parser.error(f"{args.file}: no such file (give the path of a .safetensors file)")
    arena = SharedArena() if device == "cpu" and not args.staged else None
    try:
        tensors = load_tensors(args.file, device, arena)
    except Exception as e:  # noqa: BLE001 - safetensors' own words say what is wrong with the file
        parser.error(f"{args.file}: not a readable .safetensors file ({e})")
    with WeightSender(tensors, bucket_bytes=args.bucket_bytes, checksums=args.checksums, arena=arena,
                      backends=[args.backend], one_copy=False if args.staged else None) as sender:
        offer = sender.offer(version=0)
        peer = subprocess.Popen([sys.executable, "-m", "rlsync.transfer.peer", "receive", "--file", args.file,
                                 "--device", receiver_device, "--backend", args.backend,
                                 "--timeout", str(args.timeout)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        peer.stdin.write(encode(offer) + "\n")
        peer.stdin.flush()
        answer = decode(pb.Answer, _line(peer, "ANSWER"))
        report = sender.send(offer, [answer], timeout=args.timeout)
        result = json.loads(_line(peer, "RESULT"))
        peer.wait()
    verified = bool(result.get("ok") and result.get("verified"))
    print(json.dumps({"backend": args.backend, "bytes": report.nbytes, "tensors": len(tensors),
                      "seconds": round(report.seconds, 6), "GB/s": round(report.gbps, 3), "verified": verified,
                      "one_copy": offer.one_copy, **({"error": result["error"]} if "error" in result else {})}))
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
