"""The block FP8 quantizer against vLLM's own reference (vllm.utils.deep_gemm.per_block_cast_to_fp8),
bit for bit, over shapes that are and are not multiples of 128; scales rounded to powers of two
before quantizing; the edge cases (zero blocks, huge values) and the errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import interpreted
from rlsync.errors import InvalidArgument
from rlsync.quant.fp8_blocks import (BLOCK, FP8_MAX, block_amax, dequantize_blocks, quantize_blocks, scale_shape,
                                     scales_of)

pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)


def _vllm_reference():
    """vLLM's quantizer, its arithmetic as written (eager), as on the GPU (tests/gpu/test_fp8_gpu.py): vLLM wraps
    it in torch.compile, which on a CPU has Inductor compile C++ for every dtype and flag (this file took 118 s with
    a cold cache, 71 CPU-s of them in the C++ compiler; 31 s eager) and which past its recompile limit runs eager
    anyway."""
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except Exception as e:  # noqa: BLE001 - vLLM missing or not importable here
        pytest.skip(f"vLLM's reference quantizer is not importable: {e}")

    def eager(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return per_block_cast_to_fp8(*args, **kwargs)

    return eager


def _weights(m: int, n: int, seed: int, dtype=torch.bfloat16, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g) * spread
    # rows of very different magnitude, so blocks get very different scales
    x *= torch.logspace(-3, 2, m).unsqueeze(1)[torch.randperm(m, generator=g)]
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


SHAPES = [(256, 384), (1, 1), (129, 127), (640, 129)]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_identical_to_vllm(shape, pow2):
    reference = _vllm_reference()
    x = _weights(*shape, seed=sum(shape))
    q, s = quantize_blocks(x, pow2=pow2)
    q_ref, s_ref = reference(x, [128, 128], use_ue8m0=pow2)
    assert _same_bits(s, s_ref.float().contiguous())
    assert _same_bits(q, q_ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 400), n=st.integers(1, 400), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]), pow2=st.booleans(),
       spread=st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
def test_bit_identical_to_vllm_any_shape(m, n, seed, dtype, pow2, spread):
    reference = _vllm_reference()
    x = _weights(m, n, seed, dtype, spread)
    q, s = quantize_blocks(x, pow2=pow2)
    q_ref, s_ref = reference(x, [128, 128], use_ue8m0=pow2)
    assert s.shape == scale_shape((m, n))
    assert _same_bits(s, s_ref.float().contiguous())
    assert _same_bits(q, q_ref)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 300), n=st.integers(1, 300), seed=st.integers(0, 2**16), pow2=st.booleans())
def test_round_trip_within_fp8_precision(m, n, seed, pow2):
    x = _weights(m, n, seed, torch.float32)
    q, s = quantize_blocks(x, pow2=pow2)
    back = dequantize_blocks(q, s, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, or of the block's smallest normal step
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m, :n]
    assert torch.all((back - x).abs() <= x.abs() / 16 + full * 2.0 ** -9 + 1e-30)
    assert q.float().abs().max() <= FP8_MAX


def test_power_of_two_scales_rounded_before_quantizing():
    x = _weights(256, 256, seed=3, dtype=torch.float32)
    q, s = quantize_blocks(x, pow2=True)
    assert torch.equal(s, torch.pow(2.0, torch.round(torch.log2(s))))  # every scale a power of two
    assert torch.all(s >= block_amax(x) / FP8_MAX)  # rounded up: nothing saturates
    # the values were quantized with the rounded scale, not rounded afterwards
    assert torch.equal(q, (x * (1.0 / s).repeat_interleave(128, 0).repeat_interleave(128, 1)).to(q.dtype))
    _, plain = quantize_blocks(x)
    assert torch.all(s / plain < 2) and torch.all(s / plain >= 1)


def test_zero_block_gets_the_floor_scale_and_zeros():
    x = torch.zeros(130, 200)
    x[129, 199] = 3.0
    q, s = quantize_blocks(x)
    assert s[0, 0].item() == pytest.approx(1e-4 / FP8_MAX) and s[1, 1].item() == pytest.approx(3.0 / FP8_MAX)
    assert torch.count_nonzero(q.float()) == 1 and q.float()[129, 199].item() == FP8_MAX


def test_amax_of_parts_is_the_amax_of_the_whole():
    x = _weights(300, 260, seed=1)
    top, bottom = x[:200], x[200:]
    # rows 200..299 start inside block row 1 (128..255): a block cut in two
    parts = torch.zeros(scale_shape(x.shape))
    parts[:2] = block_amax(top)
    cut = torch.zeros(scale_shape(x.shape))
    padded = torch.cat([torch.zeros(72, 260, dtype=x.dtype), bottom])  # rows 128..299 of the whole
    cut[1:] = block_amax(padded)
    assert torch.equal(torch.maximum(parts, cut), block_amax(x))


def test_errors_say_what_is_wrong():
    with pytest.raises(InvalidArgument, match="2-D"):
        quantize_blocks(torch.zeros(4, 4, 4))
    with pytest.raises(InvalidArgument, match="floating-point"):
        quantize_blocks(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(InvalidArgument, match="block size"):
        scale_shape((4, 4), (0, 128))
    q, s = quantize_blocks(torch.ones(256, 256))
    with pytest.raises(InvalidArgument, match=r"expected \[2, 2\]"):
        dequantize_blocks(q, s[:1])
    assert BLOCK == (128, 128) and scales_of(torch.tensor([0.0])).item() > 0


MANY_RUN = """
import json, sys, torch
from rlsync.quant import fp8_kernel as k
from rlsync.quant.fp8_blocks import FP8, scale_shape
g = torch.Generator().manual_seed(int(sys.argv[1]))
shapes = [(128, 128), (1, 1), (300, 77), (129, 257), (5, 640)]
xs = [(torch.randn(*s, generator=g) * 10 ** torch.randint(-3, 3, (1,), generator=g)).to(d)
      for s, d in zip(shapes, [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16])]
xs.append(torch.randn(256, 300, generator=g).to(torch.bfloat16)[:, 7:263])  # rows apart: x's own row stride
out = {}
for pow2 in (False, True):
    one = [(torch.empty(x.shape, dtype=FP8), torch.empty(scale_shape(x.shape), dtype=torch.float32)) for x in xs]
    many = [(torch.empty(x.shape, dtype=FP8), torch.empty(scale_shape(x.shape), dtype=torch.float32)) for x in xs]
    for x, (q, s) in zip(xs, one):  # the one-weight kernel, interpreted
        k._launch(x, q, s, (128, 128), pow2)
    k._on_kernel = lambda x: x.dim() == 2 and x.numel() > 0  # its launches over these (CPU) tensors, interpreted
    quantizer = k.ManyQuantizer([(x, q, s) for x, (q, s) in zip(xs, many)], (128, 128), pow2)
    quantizer.run()
    out[str(pow2)] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(c, d)
                         for (a, c), (b, d) in zip(one, many))
    out["table"] = sum(len(owner) for _, _, owner in quantizer.launches)  # blocks: (128, 128) and (5, 640)
    out["alone"] = [tuple(x.shape) for x, _, _ in quantizer.alone]  # what its hints would not hold for
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_one_launch_over_many_weights_writes_what_one_launch_each_does_under_tritons_interpreter(seed):
    """ManyQuantizer's kernel (every block of every weight one program, found from a kept table), run on the
    CPU by Triton's interpreter: the same FP8 values and scales as the one-weight kernel, weight by weight,
    over mixed dtypes, shapes that are not multiples of 128, a weight whose rows lie apart, and power-of-two
    scales; weights its alignment hints would not hold for go one by one. (The interpreter rounds FP8
    otherwise than a GPU: bits against the reference are the GPU test's.)"""
    assert interpreted(MANY_RUN, seed) == {"False": True, "True": True, "table": 1 + 5,
                                           "alone": [[1, 1], [300, 77], [129, 257], [256, 256]]}


VECTORS_RUN = """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlsync.quant import fp8_box_kernel as bk, fp8_kernel as k

def ptx(fn, **constexprs):  # sm_90 PTX with no GPU; the table's and owner's addresses 16-byte aligned, as launched
    sig = {a: "constexpr" if a.isupper() else "*i64" if a == "table" else "*i32" if a == "owner" else "fp32"
           for a in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(BM=128, BN=128, KIND=0, ALIGN=16, **constexprs),
                    attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

q = r"(?:\\.[a-z_]+)*"  # (state space, cache qualifiers)
counts = (r"ld\\.global" + q + r"\\.v4\\.", r"st\\.global" + q + r"\\.v4\\.",
          r"(?:ld|st)\\.global" + q + r"\\.b(?:8|16) ")
out = {name: [len(re.findall(c, code)) for c in counts]
       for name, code in (("many", ptx(k._quantize_many, MODE=0)), ("boxes", ptx(bk._quantize_boxes, MODE=2)))}
print(json.dumps(out))
"""


def test_the_table_kernels_load_and_store_16_byte_vectors_when_compiled_for_sm90():
    """What the table kernels' alignment hints are for, checked in the code Triton makes (compiled for an H100/H200,
    no GPU needed): each thread's 64 bf16 values of a 128 x 128 block in 8 16-byte loads, its FP8 values in 4
    16-byte stores, no 1- or 2-byte access. (A hint put on a helper's returned value once lay on the call op,
    which Triton 3.7's inliner drops: every element its own access, 254 registers, 4x slower on an H200.)"""
    pytest.importorskip("triton")
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    import rlsync
    libs = os.path.dirname(os.path.dirname(rlsync.__file__))  # (the subprocess compiles this test's rlsync)
    done = subprocess.run([sys.executable, "-c", VECTORS_RUN], capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                               "PYTHONPATH": os.pathsep.join([libs, os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"many": [8, 4, 0], "boxes": [8, 4, 0]}


def test_the_one_launch_takes_only_weights_whose_offsets_fit_in_32_bits():
    """ManyQuantizer's kernel indexes a weight in int32 (its addresses 64-bit): a weight whose block grid reaches
    2**31 elements from its start goes one by one."""
    from rlsync.quant.fp8_blocks import FP8
    from rlsync.quant.fp8_kernel import _aligned

    def pair(m, n):
        return (torch.empty(m, n, dtype=torch.bfloat16, device="meta"), torch.empty(m, n, dtype=FP8, device="meta"),
                torch.empty(scale_shape((m, n)), device="meta"))

    assert _aligned(*pair(151936, 2560))  # Qwen3's embedding: 389M elements
    assert _aligned(*pair(16384, 131072))  # its last offset 16384 * 131072 - 1 = 2**31 - 1
    assert not _aligned(*pair(16384, 131072 + 16))  # (its last block's masked columns past 2**31)
    assert not _aligned(*pair(16385, 131072))  # (one more row: its last block's masked rows too)


BANDS_RUN = """
import json, sys, torch
from rlsync.quant import fp8_kernel as k
from rlsync.quant.fp8_blocks import FP8, scale_shape
g = torch.Generator().manual_seed(int(sys.argv[1]))
x = (torch.randn(700, 300, generator=g) * 3).to(torch.bfloat16)
whole = (torch.empty(x.shape, dtype=FP8), torch.empty(scale_shape(x.shape), dtype=torch.float32))
k._launch(x, *whole, (128, 128), False)
launches = []
kernel = k._quantize_block
k._quantize_block = type("Counted", (), {"__getitem__": lambda _, grid: launches.append(grid) or kernel[grid]})()
k._INDEX_LIMIT = 128 * 300 * 2 + 384  # as if 2**31: two block rows of this weight fit in one launch
banded = (torch.empty(x.shape, dtype=FP8), torch.empty(scale_shape(x.shape), dtype=torch.float32))
k._launch(x, *banded, (128, 128), False)
print(json.dumps({"launches": [list(g) for g in launches],
                  "same": torch.equal(whole[0].view(torch.uint8), banded[0].view(torch.uint8))
                  and torch.equal(whole[1], banded[1])}))
"""


def test_a_weight_past_32_bit_offsets_is_quantized_in_bands_of_whole_block_rows_under_tritons_interpreter():
    """The one-weight kernel's offsets are int32: a weight whose grid reaches 2**31 elements goes in bands of
    whole 128-row blocks, each from its own start (here the limit lowered to two block rows): the same FP8
    values and scales as one launch over it."""
    assert interpreted(BANDS_RUN, 0) == {"launches": [[2, 3], [2, 3], [2, 3]], "same": True}
