"""Publishing from a user's model (rlsync.publish): seconds, GB/s and the ratio to the limit measured in
the same run, per case (ranks, layout, backend), with the peak extra memory each rank needed against
the bound (two buckets plus the largest tensor). Prints one JSON line per case, then a summary.

    python bench/publish.py                       # CPU: 1 rank (as is / cast on the fly)
    python bench/publish.py --device cuda         # GPU: cuda_ipc to GPU 0

Layouts: "module" = a plain module's parameters, one allocation each, sent as they are; "cast" = fp32
parameters published as bf16 (produced tensor by tensor); "fp8" = bf16 parameters whose 2-D weights are
published as block FP8 plus scales, quantized by the trainer into a buffer of its own at each offer (one kernel
per weight; its time counts), then moved as resident weights, against the quantize kernel's limit (3 bytes
moved an element at the copy rate) plus the D2D copy of what is sent (`--only fp8` runs these alone).
Sharded models (FSDP2 over several ranks): bench/sharded.py, the rank-0 path and routes side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402
from transfer import Receivers, _timed, d2d_limit, memcpy_limit  # noqa: E402

from rlsync.publish import WeightMap  # noqa: E402
from rlsync.publish.quantized import quantized  # noqa: E402
from rlsync.publish.source import module_source  # noqa: E402
from rlsync.quant.fp8_format import parse_fp8  # noqa: E402
from rlsync.transfer import WeightSender  # noqa: E402
from rlsync.transfer.armed import open_bell, ring_bell  # noqa: E402
from rlsync.transfer.source import StreamedSource, run_pass  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402

GB = 1e9


def build_module(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str) -> nn.Module:
    """A module whose parameters have exactly these dotted names and shapes."""
    root = nn.Module()
    for i, (name, shape) in enumerate(shapes.items()):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.full(shape, float(i % 7) + 0.5, dtype=dtype,
                                                                device=device)))
    return root


class Peak:
    """Peak memory above what was in use at the start: CUDA's allocator peak, or sampled RSS on CPU."""

    def __init__(self, device: str):
        self.device, self.cuda = device, device.startswith("cuda")
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.start = torch.cuda.memory_allocated(device)
            return
        import psutil

        self.process, self.start = psutil.Process(), psutil.Process().memory_info().rss
        self.top, self.running = self.start, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.top = max(self.top, self.process.memory_info().rss)
            time.sleep(0.002)

    def extra(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.start
        self.running = False
        self.thread.join()
        return self.top - self.start


def run_case(model: nn.Module, weights: WeightMap, backend: str, receivers: list[str], bucket: int, repeats: int,
             device: str, ranks: int, rank: int, hold: bool = False, pull: bool = False, fmt=None,
             arm: bool = False) -> dict | None:
    """pull: receivers on the trainer's GPU copy the weights themselves, before they answer (what a
    colocated replica does); their own seconds are the figure. fmt: a WeightFormat the source is quantized to.
    arm (with hold and pull): each receiver arms its pull again behind its bell after each update, and the
    sender writes the bell once the weights are final, as rlsync's trainer does for a colocated replica that
    armed at its wake (rlsync.transfer.armed): the figure is then the sender's, from the quantize to the
    receivers' report that the copy is done (`end_to_end_seconds`, which every case reports too)."""
    source, _ = module_source(model, weights)
    if fmt is not None:
        source = quantized(source, fmt)
    passes = 1 if isinstance(source, StreamedSource) else 0
    produce_seconds = [0.0]
    if passes:  # time spent making the tensors (gather from shards, cast) apart from moving them
        produce = source.produce

        def timed(i):
            start = time.perf_counter()
            t = produce(i)
            produce_seconds[0] += time.perf_counter() - start
            return t

        source.produce = timed
    peak = Peak(device)
    if rank != 0:  # only takes part in the gathers, one pass per transfer
        for _ in range(repeats + 1):
            for _ in range(passes):
                run_pass(source)
        return {"rank": rank, "peak_extra_bytes": peak.extra()}
    group = Receivers(receivers, backend, hold, arm=arm)
    bells = [open_bell(h, torch.device(device)) for h in group.bells]
    seconds, quantize_seconds, stages, adopted, spans = [], [], [], 0, []
    refresh = getattr(source, "refresh", None) if fmt is not None else None  # a publisher's offer fills it anew
    try:
        with WeightSender(source, bucket_bytes=bucket, backends=[backend]) as sender:
            nbytes = sum(s.nbytes for s in source.specs())
            largest = max(s.nbytes for s in source.specs())
            for i in range(repeats + 1):  # the first one warms up
                took = 0.0
                start = time.perf_counter()
                if refresh is not None and i:  # (the first one was filled as it was made)
                    refresh()
                    took = time.perf_counter() - start
                for bell in bells:  # the weights are final: start the copies armed behind the bells
                    ring_bell(bell, i + 1)
                offer = sender.offer(version=i, pull=pull)
                if bells:
                    offer.mapped.bell, offer.mapped.waits = i + 1, True
                answers = group.answers(offer)
                report = sender.send(offer, answers, timeout=600)
                results = group.results()
                end = time.perf_counter()
                if not all(r["ok"] for r in results):
                    raise RuntimeError(f"{backend}: a receiver failed")
                pulled = all(a.pull for a in answers)  # done by the receivers before they answered
                if i:  # (quantizing into the buffer, then moving it)
                    adopted += all(r["adopted"] for r in results)
                    spans.append(end - start)  # the sender's view: the offer's trip and the answers' too
                    seconds.append(spans[-1] if bells else
                                   took + (max(r["seconds"] for r in results) if pulled else report.seconds))
                    quantize_seconds.append(took)
                    if pulled and not bells:
                        stages.append(max(results, key=lambda r: r["seconds"])["stages"])
                else:
                    produce_seconds[0] = 0.0
    finally:
        group.close()
    crashed = [p.returncode for p in group.procs if p.returncode]
    if crashed:  # a receiver that aborts at exit is a failed run, not a footnote on stderr
        raise RuntimeError(f"{backend}: receiver exit codes {crashed}")
    s = statistics.median(seconds)
    mode = "pull" if pulled else "one_copy" if offer.one_copy else "staged"
    return {"ranks": ranks, "backend": backend, "mode": mode, "cast_by_receiver": bool(offer.mapped.dtype),
            "held": hold, **({"armed": True, "adopted": f"{adopted} of {repeats}"} if bells else {}),
            "streamed": bool(passes), "bytes": nbytes, "tensors": len(source.specs()), "seconds": round(s, 4),
            "GB/s": round(nbytes / s / GB, 3), "end_to_end_seconds": round(statistics.median(spans), 4),
            "peak_extra_bytes": {0: peak.extra()},
            "bound_bytes": 2 * bucket + largest, "produce_seconds": round(produce_seconds[0] / repeats, 4),
            **({"quantize_seconds": round(statistics.median(quantize_seconds), 5)} if refresh is not None else {}),
            # a pull's stages on its slowest receiver (medians, ms): where its time beyond the copy goes
            **({"receiver_ms": {k: round(1e3 * statistics.median(s.get(k, 0.0) for s in stages), 3)
                                for k in stages[0]}} if stages else {})}


def cast_limit(elements: int, device: str) -> float:
    """GB/s of bf16 written by one fp32 -> bf16 cast of `elements` (median of 5): a cast's own limit."""
    src = torch.ones(elements, dtype=torch.float32, device=device)
    dst = torch.empty(elements, dtype=torch.bfloat16, device=device)

    def cast():
        dst.copy_(src)
        torch.cuda.synchronize(device)

    return round(elements * 2 / _timed(cast, 5) / GB, 1)


def single_rank(args, shapes, bucket) -> list[dict]:
    device = "cuda:0" if args.device == "cuda" else "cpu"
    cases = []
    if args.device == "cpu":
        limit = {"memcpy_1_thread": round(memcpy_limit(1 << 30, 1), 2)}
        plan = [("module", torch.bfloat16, None, "shm", ["cpu"], False, False),
                ("module", torch.bfloat16, None, "gloo", ["cpu"], False, False),
                ("cast", torch.float32, torch.bfloat16, "shm", ["cpu"], False, False),
                ("fp8", torch.bfloat16, None, "shm", ["cpu"], False, False)]
        key = "memcpy_1_thread"
    else:
        limit = {"d2d_copy": round(d2d_limit(4 << 30, device), 1), "cast_fp32_to_bf16": cast_limit(1 << 30, device)}
        # held: the replica keeps the model's storages mapped between updates (as rlsync's replicas do for
        # a trainer on their GPU), else it maps and closes every storage at each update
        # a replica; pull: it copies before it answers, as a colocated replica does (else over a connection),
        # and a cast is then its own, out of the fp32 parameters (else the trainer's, streamed through slots);
        # "armed": held, and the pull armed again after each update, started by the trainer's bell
        plan = [("module", torch.bfloat16, None, "cuda_ipc", [device], False, False),
                ("module", torch.bfloat16, None, "cuda_ipc", [device], True, False),
                ("module", torch.bfloat16, None, "cuda_ipc", [device], True, True),
                ("cast", torch.float32, torch.bfloat16, "cuda_ipc", [device], False, False),
                ("cast", torch.float32, torch.bfloat16, "cuda_ipc", [device], False, True),
                ("cast", torch.float32, torch.bfloat16, "cuda_ipc", [device], True, True),
                ("fp8", torch.bfloat16, None, "cuda_ipc", [device], False, False),
                ("fp8", torch.bfloat16, None, "cuda_ipc", [device], True, True),
                ("fp8", torch.bfloat16, None, "cuda_ipc", [device], True, "armed")]
        key = "d2d_copy"
    if args.only:
        plan = [p for p in plan if p[0] in args.only.split(",")]
    for layout, dtype, out, backend, receivers, hold, pull in plan:
        model = build_module(shapes, dtype, device)
        fmt = None
        if layout == "fp8":
            fmt = pb.WeightFormat(fp8=parse_fp8({"quant_method": "fp8", "weight_block_size": [128, 128]}))
            fmt.fp8.weights.extend(n for n, p in model.named_parameters() if p.dim() == 2)
        r = run_case(model, WeightMap(dtype=out), backend, receivers, bucket, args.repeats, device, 1, 0, hold,
                     bool(pull), fmt, arm=pull == "armed")
        r.update(layout=layout, limit=key, limit_GB_s=limit[key], ratio=round(r["GB/s"] / limit[key], 3))
        if fmt is not None:  # quantize (read 2, write 1 byte an element) then copy what is sent, each at its limit
            elements = sum(p.numel() for n, p in model.named_parameters() if n in set(fmt.fp8.weights))
            limit_s = 3 * elements / (2 * limit[key] * GB) + r["bytes"] / (limit[key] * GB)
            r.update(limit="quantize_then_d2d", limit_seconds=round(limit_s, 5),
                     ratio=round(limit_s / r["seconds"], 3), bf16_bytes=sum(p.nbytes for p in model.parameters()),
                     kept_buffer_bytes=r["bytes"])  # (the quantized weights kept on the device: in the peak too)
        if layout == "cast" and "cast_fp32_to_bf16" in limit:  # the cast kernel's own rate bounds a cast
            r.update(cast_limit_GB_s=limit["cast_fp32_to_bf16"],
                     ratio_to_cast=round(r["GB/s"] / limit["cast_fp32_to_bf16"], 3))
        print(json.dumps(r), flush=True)
        cases.append(r)
        del model
    return cases


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        # Large blocks straight from mmap and back to the OS when freed, so resident memory shows what
        # a publish holds (glibc otherwise raises its threshold and keeps freed blocks).
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--preset", default="", help="model shapes (default: small on CPU, qwen3-4b on GPU)")
    parser.add_argument("--bucket-mib", type=int, default=0, help="default: 32 on CPU, 512 on GPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated layouts to run (module, cast, fp8)")
    args = parser.parse_args()
    args.preset = args.preset or ("small" if args.device == "cpu" else "qwen3-4b")
    args.bucket_mib = args.bucket_mib or (32 if args.device == "cpu" else 512)
    shapes, bucket = preset_shapes(args.preset), args.bucket_mib << 20
    cases = single_rank(args, shapes, bucket)
    print(json.dumps({"preset": args.preset, "device": args.device, "bucket_bytes": bucket, "cases": cases}))


if __name__ == "__main__":
    main()
