"""How soon an armed copy (rlsync.transfer.armed) is done after its bell is written, by who writes
it and how, against the device-to-device copy limit measured in the same run. One GPU, two
processes: this one plays the trainer (its weights, mapped by the other), a child plays the
replica (its bell, and a copy of the trainer's weights into memory of its own, armed behind it).

    python bench/armed_copy.py [--bytes 3.44e9] [--repeats 6] [--idle 0.3]

Writers: "replica" (the replica writes its own bell: no other process in the way), "stream_write"
(the trainer, with ring_bell: a stream memory operation on its stream), "kernel" (the trainer, with
a fill kernel on its stream, as before 2026-11-24); then, for a bell in the replica's pinned host memory
(rlsync.transfer.host_bell), "host_stream_write" (the trainer, with ring_bell) and "host_cpu" (the replica, by a
store of the CPU: how a replica lets a copy armed beside generation go). The GPU idles `--idle` seconds before each
bell, as it does between a trainer's step and its offer. Times run from the writer's call to the
replica seeing the copy's event done (time.perf_counter, one clock for both processes on Linux).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from rlsync.transfer.armed import Armed, Bell, open_bell, ring_bell
from rlsync.transfer.host_bell import HostBell
from rlsync.transfer.memory import export_cuda, open_cuda

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer import d2d_limit  # noqa: E402

DEVICE = torch.device("cuda", 0)
WRITERS = ("replica", "stream_write", "kernel", "host_stream_write", "host_cpu")


def replica(src_handle: str, nbytes: int, repeats: int, idle: float) -> None:
    """The child: arms one copy per bell, has it rung, and reports how long after the ring it ended."""
    faulthandler.enable()
    src = open_cuda(bytes.fromhex(src_handle), DEVICE)[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    bells = {"device": Bell(DEVICE), "host": HostBell(DEVICE)}
    print(json.dumps({"bell": bells["device"].handle.hex(), "host_bell": bells["host"].handle.hex()}), flush=True)
    for writer in WRITERS:
        bell = bells["host" if writer.startswith("host") else "device"]
        for i in range(repeats + 1):  # the first warms up
            dst.zero_()  # so that the check below sees the last copy's bytes
            armed = Armed(bell, lambda: dst.copy_(src, non_blocking=True), dst.numel(), key=())
            time.sleep(idle)
            if writer == "replica":
                start = time.perf_counter()
                ring_bell(bell.flag, i + 1)
            elif writer == "host_cpu":
                start = time.perf_counter()
                bell.write(i + 1)
            else:
                print(json.dumps({"ring": writer, "value": i + 1}), flush=True)
                start = json.loads(sys.stdin.readline())["start"]
            while not bell.event.query():
                pass
            ms = (time.perf_counter() - start) * 1e3
            armed.disarm()  # (the copy is done: this only writes the bell again)
            if i:
                print(json.dumps({"writer": writer, "ms": ms}), flush=True)
    assert torch.equal(dst, src), "the armed copy's bytes differ from the source's"
    print(json.dumps({"done": True}), flush=True)


def trainer(nbytes: int, repeats: int, idle: float) -> dict:
    limit = d2d_limit(nbytes, "cuda:0")  # GB/s, a warm loop in this process
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)
    child = subprocess.Popen([sys.executable, __file__, "--replica", export_cuda(src).SerializeToString().hex(),
                              "--bytes", str(nbytes), "--repeats", str(repeats), "--idle", str(idle)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    times: dict[str, list[float]] = {w: [] for w in WRITERS}
    flags = {}
    for line in child.stdout:
        msg = json.loads(line)
        if "bell" in msg:
            flags = {"device": open_bell(bytes.fromhex(msg["bell"]), DEVICE),
                     "host": open_bell(bytes.fromhex(msg["host_bell"]), DEVICE)}
        elif "ring" in msg:
            start = time.perf_counter()
            if msg["ring"] == "kernel":
                flags["device"].view(torch.int32)[:1].fill_(msg["value"])
            else:
                ring_bell(flags["host" if msg["ring"].startswith("host") else "device"], msg["value"])
            child.stdin.write(json.dumps({"start": start}) + "\n")
            child.stdin.flush()
        elif "writer" in msg:
            times[msg["writer"]].append(msg["ms"])
        elif msg.get("done"):
            break
    if child.wait(timeout=60) != 0:
        raise SystemExit(f"the replica process failed (exit {child.returncode})")
    device_ms = nbytes / limit / 1e9 * 1e3
    out = {"bytes": nbytes, "idle_s": idle, "d2d_copy_GB/s": round(limit, 1), "d2d_copy_ms": round(device_ms, 3)}
    for writer, ms in times.items():
        median = statistics.median(ms)
        out[writer] = {"bell_to_done_ms": round(median, 3), "vs_d2d": round(device_ms / median, 3),
                       "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=float, default=3.44e9)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--idle", type=float, default=0.3, help="seconds the GPU idles before each bell")
    parser.add_argument("--replica", metavar="HANDLE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replica:
        replica(args.replica, int(args.bytes), args.repeats, args.idle)
    else:
        print(json.dumps(trainer(int(args.bytes), args.repeats, args.idle)))


if __name__ == "__main__":
    main()
