"""Can a process on GPU 1 map GPU 0's memory by CUDA IPC handle, and copy it at the link's rate beside a
decode-like load? (What cuda_ipc across GPUs of one host rests on: rlsync.transfer.handshake.)

A holder process on GPU 0 exports 3.44 GB (Qwen3-1.7B in bf16); a reader process opens the handle and
copies it into its own GPU, for each way the reader may see the GPUs: only its own (CUDA_VISIBLE_DEVICES=1),
both with the mapping opened on its own GPU, both with it opened on GPU 0. Each: the open (CUDA already
started), one copy_ (a copy engine), the same beside 28 bf16 matmuls of a decode step looping on another
stream, and, where the mapping is opened on the reader's GPU, the batched table kernel (SMs reading over the
link) over the bytes cut in 64 pieces. Ratios against a
raw NCCL broadcast of the same bytes in the same run. Prints one JSON object.

    python bench/peer_map.py [--bytes 3441185608]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import _timed, nccl_limit  # noqa: E402


def hold(path: str, nbytes: int) -> None:
    from rlsync.transfer.memory import export_cuda

    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    Path(path + ".tmp").write_bytes(export_cuda(src).SerializeToString())
    os.rename(path + ".tmp", path)
    while not os.path.exists(path + ".done"):
        time.sleep(0.05)


def decoding(device: torch.device, stop: threading.Event) -> None:
    """A decode step's shape of work, looping on a stream of its own until `stop`."""
    def run():
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        weights = [torch.randn(2048, 6144, dtype=torch.bfloat16, device=device) for _ in range(28)]
        x = torch.randn(32, 2048, dtype=torch.bfloat16, device=device)
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for w in weights:
                    x = (x @ w)[:, :2048].contiguous()
                stream.synchronize()
    threading.Thread(target=run, daemon=True).start()


def timed(fn, device: torch.device) -> float:
    """Median seconds of fn() to its end on `device` (transfer._timed: one warm-up, then 5)."""
    return _timed(lambda: (fn(), torch.cuda.synchronize(device)), 5)


def read(path: str, open_on: int, nbytes: int) -> dict:
    from rlsync.transfer import spans
    from rlsync.transfer.memory import import_cuda
    from rlsync.transfer.v1 import transfer_pb2 as pb

    while not os.path.exists(path):
        time.sleep(0.05)
    handle = pb.CudaIpcHandle.FromString(Path(path).read_bytes())
    own = torch.device("cuda:0")
    out = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "open_on": open_on}
    try:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=own)  # (CUDA started before the open is timed)
        torch.cuda.synchronize(own)
        start = time.perf_counter()
        src = import_cuda(handle, torch.device(f"cuda:{open_on}"))
        out["open_ms"] = round((time.perf_counter() - start) * 1e3, 2)

        def copy():
            with torch.cuda.device(own):
                dst.copy_(src, non_blocking=True)

        out["copy_GB/s"] = round(nbytes / timed(copy, own) / 1e9, 1)
        assert int(dst[:1000].sum()) == 1000 and int(dst[-1000:].sum()) == 1000, "the bytes arrived"
        stop = threading.Event()
        decoding(own, stop)
        time.sleep(1)
        out["copy_beside_decoding_GB/s"] = round(nbytes / timed(copy, own) / 1e9, 1)
        stop.set()
        if src.device == own:  # (the table kernel takes pairs on one device)
            step = nbytes // 64
            pairs = [(src[i * step:(i + 1) * step], dst[i * step:(i + 1) * step]) for i in range(64)]
            out["table_GB/s"] = round(step * 64 / timed(lambda: spans.copy_all(pairs), own) / 1e9, 1)
    except Exception as e:  # noqa: BLE001 - a way that does not work here is reported, the others still run
        out["error"] = repr(e)[:300]
    Path(path + ".done").touch()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=float, default=3441185608)
    parser.add_argument("--role", choices=("holder", "reader"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--open-on", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    nbytes = int(args.bytes)
    if args.role == "holder":
        return hold(args.path, nbytes)
    if args.role == "reader":
        return print(json.dumps(read(args.path, args.open_on, nbytes)), flush=True)
    if torch.cuda.device_count() < 2:
        sys.exit("peer_map.py needs 2 GPUs")
    out = {"gpu": torch.cuda.get_device_name(0), "bytes": nbytes, "readers": []}
    me = [sys.executable, __file__, "--bytes", str(nbytes)]
    for visible, open_on in [("1", 0), ("1,0", 0), ("1,0", 1)]:
        with tempfile.TemporaryDirectory(prefix="rlsync-peer-map-") as folder:
            path = str(Path(folder) / "handle")
            holder = subprocess.Popen([*me, "--role", "holder", "--path", path],
                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
            try:
                reader = subprocess.run([*me, "--role", "reader", "--path", path, "--open-on", str(open_on)],
                                        env={**os.environ, "CUDA_VISIBLE_DEVICES": visible}, capture_output=True,
                                        text=True, timeout=300)
                lines = reader.stdout.strip().splitlines()
                out["readers"].append(json.loads(lines[-1]) if lines else
                                      {"visible": visible, "open_on": open_on, "error": reader.stderr[-600:]})
            finally:  # a reader that failed early leaves the holder waiting
                holder.kill()
                holder.wait()
    limit = out["nccl_broadcast_GB/s"] = round(nccl_limit(nbytes, 2), 1)
    for r in out["readers"]:
        for key in ("copy_GB/s", "copy_beside_decoding_GB/s", "table_GB/s"):
            if key in r:
                r[key.replace("GB/s", "vs_nccl")] = round(r[key] / limit, 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
