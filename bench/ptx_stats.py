"""PTX statistics of the block FP8 kernels (rlsync.quant.fp8_kernel), compiled for sm_90 without a GPU:
vector vs scalar global loads and stores, 64-bit integer ops, registers and spills per thread (cuobjdump).
What Triton's launcher would specialize is given by hand: pointers 16-byte aligned, and for the one-weight
kernel n and the row strides multiples of 16 ("tt.divisibility" = 16), m and n as i32. The table kernels
(ManyQuantizer's, and with no paths given the box kernel's, fp8_box_kernel) read theirs from memory: what
they know of them is their own hints. Paths: other versions of fp8_kernel.py (e.g. `git show REV:...`).

    python bench/ptx_stats.py [path/to/fp8_kernel.py ...] [--mode 0|1|2] [--dump DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libs"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PATTERNS = {  # (PTX: a vector's type follows .v2/.v4; a scalar's follows the state space and cache qualifiers)
    "ld.v4": r"\bld\.global(?:\.[a-z_]+)*\.v4\.", "ld.v2": r"\bld\.global(?:\.[a-z_]+)*\.v2\.",
    "ld.scalar": r"\bld\.global(?:\.[a-z_]+)*\.[bfsu](?:8|16|32|64)\b",
    "st.v4": r"\bst\.global(?:\.[a-z_]+)*\.v4\.", "st.v2": r"\bst\.global(?:\.[a-z_]+)*\.v2\.",
    "st.scalar": r"\bst\.global(?:\.[a-z_]+)*\.[bfsu](?:8|16|32|64)\b",
    "mul64": r"\bmul\.(?:lo\.[su]64|wide\.[su]32)\b", "add64": r"\badd\.[su]64\b",
    "divrem64": r"\b(?:div|rem)\.[su]64\b", "lines": r"\n",
}
ONE = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", m="i32", n="i32", stride_xm="i32", stride_qm="i32",
           floor="fp32", fp8_max="fp32", BM="constexpr", BN="constexpr", MODE="constexpr")
ONE_ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "n", "stride_xm", "stride_qm")


def stats(fn, signature: dict, constexprs: dict, aligned, dump: str | None, name: str) -> dict:
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = kernel.asm["ptx"]
    out = {k: len(re.findall(p, ptx)) for k, p in PATTERNS.items()}
    cubin = Path(dump or "/tmp") / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    out.update({k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)})
    if dump:
        for ext in ("ttir", "ttgir", "ptx"):
            Path(dump, f"{name}.{ext}").write_text(kernel.asm[ext])
    else:
        cubin.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="fp8_kernel.py files (default: this checkout's)")
    parser.add_argument("--mode", type=int, default=0, help="0: amax+values, 1: amax only, 2: values")
    parser.add_argument("--dump", help="also write each kernel's TTIR, TTGIR, PTX and cubin into this folder")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the launcher's default: silences its warning)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    paths = args.paths or [str(Path(__file__).resolve().parent.parent / "libs/rlsync/quant/fp8_kernel.py")]
    consts = dict(BM=128, BN=128, MODE=args.mode)
    for i, path in enumerate(paths):
        spec = importlib.util.spec_from_file_location(f"fp8_kernel_{i}", path)
        k = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(k)
        rows = {"one-weight": stats(k._quantize_block, ONE, consts, ONE_ALIGNED, args.dump, f"{i}-one")}
        many_args = k._quantize_many.arg_names
        sig = {a: "constexpr" if a.isupper() else {"table": "*i64", "owner": "*i32"}.get(a, "fp32")
               for a in many_args}
        extra = {"KIND": 0, **({"ALIGN": 16} if "ALIGN" in many_args else {})}
        rows["many"] = stats(k._quantize_many, sig, dict(consts, **extra), ("table", "owner"), args.dump, f"{i}-many")
        if not args.paths:
            from rlsync.quant import fp8_box_kernel as bk
            sig = {a: "constexpr" if a.isupper() else "*i64" if a == "table" else "*i32"
                   for a in bk._quantize_boxes.arg_names}
            consts = dict(BM=128, BN=128, MODE=args.mode or 2, KIND=0, ALIGN=16)  # (boxes: 1 amax, 2 values)
            rows["boxes"] = stats(bk._quantize_boxes, sig, consts, ("table", "owner"), args.dump, f"{i}-boxes")
        for kernel, row in rows.items():
            print(f"{path}  {kernel:10s} " + " ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
