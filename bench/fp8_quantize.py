"""The block FP8 quantize kernel (rlsync.quant.fp8_kernel) against its memory-bound limit, measured in
the same run: quantizing moves 3 bytes per bf16 element (read 2, write 1; the scales are 1/16384 of
that), so the limit is 3 bytes x elements / the device's copy rate (a 2-byte-in, 2-byte-out clone of
the same bf16 weights, timed here, is the copy rate). Weights of real shapes (a 1T-class MoE's
7168-wide layers) up to --gib of bf16; medians of --repeats after a warm-up; checks the kernel's bits
against the reference on one weight. Both forms: a launch per weight, and one launch for them all
(ManyQuantizer, what a publisher's kept FP8 buffer runs), with 4 and 8 warps a program. Prints one JSON
object (--out: also writes it there).

    python bench/fp8_quantize.py [--gib 8] [--repeats 10] [--out bench/results/fp8-quantize-h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libs"))
from rlsync.quant.fp8_blocks import quantize_blocks  # noqa: E402
from rlsync.quant.fp8_blocks import scale_shape  # noqa: E402
from rlsync.quant.fp8_kernel import ManyQuantizer, quantize_cuda  # noqa: E402

SHAPES = [(7168, 2048), (2048, 7168), (7168, 18432), (18432, 7168), (1536, 7168), (24576, 1536)]


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="GiB of bf16 weights to quantize per pass")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pow2", action="store_true", help="power-of-two scales (two launches: amax, values)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights, total = [], 0
    while total < args.gib * 2**30:
        m, n = SHAPES[len(weights) % len(SHAPES)]
        weights.append(torch.randn(m, n, device="cuda", dtype=torch.bfloat16))
        total += m * n * 2
    elements = sum(w.numel() for w in weights)
    outs = [torch.empty_like(w) for w in weights]

    def copy() -> None:
        for w, o in zip(weights, outs):
            o.copy_(w)

    def quant() -> None:
        for w in weights:
            quantize_cuda(w, pow2=args.pow2)

    copy_s = _time(copy, args.repeats)
    outs.clear()  # (its memory back before the quantized outputs take theirs)
    quant_s = _time(quant, args.repeats)
    kept = [(w, torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda"),
             torch.empty(scale_shape(w.shape), dtype=torch.float32, device="cuda")) for w in weights]
    many = {warps: ManyQuantizer(kept, pow2=args.pow2, num_warps=warps) for warps in (4, 8)}
    many_s = {warps: _time(m.run, args.repeats) for warps, m in many.items()}
    alone = sum(len(m.alone) for m in many.values())
    rate = 4 * elements / copy_s  # bytes moved per second by a copy (2 read + 2 written per element)
    limit_s = 3 * elements / rate
    q, s = quantize_cuda(weights[0], pow2=args.pow2)
    q_ref, s_ref = quantize_blocks(weights[0], pow2=args.pow2)  # on the weights' device, as the engine's own runs
    exact = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and \
        torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
    _, q_many, s_many = kept[0]
    many_exact = torch.equal(q.view(torch.uint8), q_many.view(torch.uint8)) and torch.equal(s, s_many)
    result = {
        "bench": "fp8_quantize", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "weights": len(weights), "bf16_bytes": 2 * elements, "pow2_scales": args.pow2, "repeats": args.repeats,
        "copy_seconds": copy_s, "copy_gbps": rate / 1e9, "quantize_seconds": quant_s,
        "quantize_gbps": 3 * elements / quant_s / 1e9, "limit_seconds": limit_s,
        "ratio_to_limit": limit_s / quant_s, "target_ratio": 0.8, "bit_identical_to_reference": exact,
        "one_launch": {f"{warps}_warps": {"seconds": t, "ratio_to_limit": limit_s / t} for warps, t in many_s.items()},
        "one_launch_weights_left_to_their_own_launch": alone, "one_launch_bit_identical_to_the_kernels": many_exact,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
