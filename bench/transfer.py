"""Weight-transfer benchmark: each channel's effective GB/s next to the physical limit measured in
the same run, on a real model's bf16 state-dict shapes. Prints one JSON object.

    python bench/transfer.py                       # CPU: shm one-copy, shm staged, gloo
    python bench/transfer.py --device cuda         # GPU: cuda_ipc one-copy/staged, nccl (2+ GPUs)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402

from rlsync.transfer import SharedArena, WeightSender  # noqa: E402
from rlsync.transfer.peer import decode, encode  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402

GB = 1e9


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def make_tensors(shapes, device: str, layout: str, arena: SharedArena | None = None) -> dict[str, torch.Tensor]:
    """bf16 tensors of `shapes`: "flat" = views into one buffer (how rlsync's trainer keeps its
    parameters), "scattered" = one allocation each (a plain state dict)."""
    total = sum(_numel(s) for s in shapes.values())
    flat = torch.empty(total, dtype=torch.bfloat16, device=device) if arena is None and layout == "flat" else None
    out, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        if arena is not None:
            t = arena.empty(n, torch.bfloat16).view(shape)
        elif flat is not None:
            t = flat[offset:offset + n].view(shape)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        offset += n
        t.fill_(float(i % 7) + 0.5)
        out[name] = t
    return out


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_limit(nbytes: int, threads: int) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), 3)
    torch.set_num_threads(previous)
    return nbytes / seconds / GB


def d2d_limit(nbytes: int, device: str) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize(device)

    return nbytes / _timed(copy, 5) / GB


_PORTS = itertools.count()  # each raw run on a port of its own: the last one's may linger


def nccl_limit(nbytes: int, world: int, form: str = "broadcast", env: dict[str, str] | None = None) -> float:
    """Raw NCCL broadcast of `nbytes` from GPU 0 to GPUs 1..world-1, one process per GPU (GB/s); or
    another `form` of bench/nccl_raw.py, under `env` (NCCL settings) besides this process's."""
    script = Path(__file__).resolve().parent / "nccl_raw.py"
    env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + (os.getpid() + next(_PORTS)) % 1000), "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(script), str(nbytes), form], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # a rank that failed leaves the others waiting in the group: they hold the GPUs and the port
        for p in procs:
            p.kill()
            p.wait()
    return json.loads(outs[0].strip().splitlines()[-1])["GB/s"]


class Receivers:
    """Receiver processes that take one offer per line and report each transfer."""

    def __init__(self, devices: list[str], backend: str, hold: bool = False, profile: str = "", arm: bool = False):
        """hold: a cuda_ipc one-copy receiver keeps the sender's storages mapped between transfers.
        profile: each receiver runs under cProfile and writes its stats to `profile`-r<i>.prof.
        arm (with hold): each receiver arms its last pull again behind its bell (`bells`: their handles),
        for the sender to start by writing it (rlsync.transfer.armed)."""
        self.procs = [subprocess.Popen([sys.executable,
                                        *(["-m", "cProfile", "-o", f"{profile}-r{i}.prof"] if profile else []),
                                        "-m", "rlsync.transfer.peer", "receive", "--loop",
                                        "--device", d, "--backend", backend, "--receiver-id", f"r{i}",
                                        "--timeout", "600", *(["--hold", "bench"] if hold else []),
                                        *(["--arm"] if arm else [])],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for i, d in enumerate(devices)]
        self.bells = [bytes.fromhex(self._line(p, "BELL")) for p in self.procs] if arm else []

    def _line(self, proc, kind):
        for raw in proc.stdout:
            if raw.startswith(kind + " "):
                return raw[len(kind) + 1:].strip()
        raise RuntimeError(f"receiver exited ({proc.wait()}) without {kind}")

    def answers(self, offer):
        for p in self.procs:
            p.stdin.write(encode(offer) + "\n")
            p.stdin.flush()
        return [decode(pb.Answer, self._line(p, "ANSWER")) for p in self.procs]

    def results(self):
        out = [json.loads(self._line(p, "RESULT")) for p in self.procs]
        # each has armed its next copy (a bell written before that would be lost); a failed one says nothing
        for p in [p for p, r in zip(self.procs, out) if r["ok"]] if self.bells else []:
            self._line(p, "ARMED")
        return out

    def close(self):
        for p in self.procs:
            p.stdin.close()
            p.wait(60)


def run_channel(tensors, backend: str, one_copy: bool, receivers: list[str], bucket: int, repeats: int,
                arena=None, hold: bool = False, profile: str = "") -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    group = Receivers(receivers, backend, hold, profile)
    seconds, data_seconds, pulled, stages = [], [], False, []
    try:
        with WeightSender(tensors, bucket_bytes=bucket, arena=arena, backends=[backend],
                          one_copy=None if one_copy else False) as sender:
            for i in range(repeats + 1):  # the first one warms up (group setup, page faults)
                offer = sender.offer(version=i, pull=one_copy)  # the receiver pulls what it can map
                assert offer.one_copy == one_copy, "one-copy availability differs from what was asked"
                answers = group.answers(offer)
                report = sender.send(offer, answers, timeout=600)
                results = group.results()
                if not all(r["ok"] for r in results):
                    raise RuntimeError(f"{backend}: {results}")
                pulled = all(a.pull for a in answers)
                if i and pulled:  # the receivers did it all, before answering (no connection)
                    seconds.append(max(r["seconds"] for r in results))
                    data_seconds.append(seconds[-1])
                    stages.append(max(results, key=lambda r: r["seconds"])["stages"])
                elif i:
                    seconds.append(report.seconds)
                    data_seconds.append(report.data_seconds)
    finally:
        group.close()
    s, d = statistics.median(seconds), statistics.median(data_seconds)
    return {"backend": backend, "mode": "pull" if pulled else "one_copy" if one_copy else "staged",
            "held": hold, "receivers": len(receivers),
            "bucket_bytes": bucket, "seconds": round(s, 4), "GB/s": round(nbytes / s / GB, 2),
            "data_seconds": round(d, 4), "data_GB/s": round(nbytes / d / GB, 2),
            # a pull's stages on its slowest receiver (medians, ms): where the time beyond the copy goes
            **({"receiver_ms": {k: round(1e3 * statistics.median(s.get(k, 0.0) for s in stages), 3)
                                for k in stages[0]}} if stages else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="qwen3-4b", help="qwen3-4b (8.8 GB bf16), qwen3-1.7b, small")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated backends to run")
    parser.add_argument("--profile", default="", help="a folder: each receiver runs under cProfile and leaves "
                                                      "<backend>-<layout>-<held|mapped>-r<i>.prof there")
    args = parser.parse_args()

    shapes = preset_shapes(args.preset)
    bucket = args.bucket_mib << 20
    only = set(filter(None, args.only.split(",")))
    out: dict = {"preset": args.preset, "device": args.device, "bucket_bytes": bucket, "limits": {}, "channels": []}
    nbytes = sum(_numel(s) * 2 for s in shapes.values())
    if args.device == "cpu":
        arena = SharedArena()
        layouts = {"arena": make_tensors(shapes, "cpu", "flat", arena)}
        out["limits"] = {"memcpy_1_thread": round(memcpy_limit(1 << 30, 1), 2),
                         "memcpy_all_threads": round(memcpy_limit(1 << 30, os.cpu_count() or 1), 2)}
        runs = [("shm", True, "arena", ["cpu"], False), ("shm", False, "arena", ["cpu"], False),
                ("gloo", False, "arena", ["cpu"], False)]
        limit_of = {"shm": "memcpy_1_thread", "gloo": "memcpy_1_thread"}
    else:
        arena = None
        layouts = {layout: make_tensors(shapes, "cuda:0", layout) for layout in ("flat", "scattered")}
        gpus = torch.cuda.device_count()
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = gpus
        out["limits"] = {"d2d_copy": round(d2d_limit(4 << 30, "cuda:0"), 1)}
        # held: the receiver keeps the storages mapped from one transfer to the next (what a replica does
        # for a trainer on its GPU), else it maps and closes them at each
        runs = [("cuda_ipc", True, "flat", ["cuda:0"], False), ("cuda_ipc", True, "scattered", ["cuda:0"], False),
                ("cuda_ipc", True, "flat", ["cuda:0"], True), ("cuda_ipc", True, "scattered", ["cuda:0"], True),
                ("cuda_ipc", False, "scattered", ["cuda:0"], False)]
        limit_of = {"cuda_ipc": "d2d_copy", "nccl": "nccl_broadcast"}
        if gpus >= 2 and (not only or "nccl" in only):
            out["limits"]["nccl_broadcast"] = round(nccl_limit(nbytes, gpus), 1)
            receivers = [f"cuda:{i}" for i in range(1, gpus)]
            runs += [("nccl", False, "flat", receivers, False), ("nccl", False, "scattered", receivers, False)]
    out["bytes"] = nbytes
    out["tensors"] = len(shapes)
    for backend, one_copy, layout, receivers, hold in runs:
        if only and backend not in only:
            continue
        profile = (os.path.join(args.profile, f"{backend}-{layout}-{'held' if hold else 'mapped'}"
                                f"{'' if one_copy else '-staged'}") if args.profile else "")
        if profile:
            os.makedirs(args.profile, exist_ok=True)
        result = run_channel(layouts[layout], backend, one_copy, receivers, bucket, args.repeats, arena, hold,
                             profile)
        limit = out["limits"][limit_of[backend]]
        result.update(layout=layout, limit=limit_of[backend], ratio=round(result["GB/s"] / limit, 3),
                      data_ratio=round(result["data_GB/s"] / limit, 3))
        out["channels"].append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
