"""The transfer checksum: deterministic, position-sensitive, alignment-proof."""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import interpreted
from rlsync.transfer.checksum import KeptAudit, audit, audit_entry, checksum_bytes, checksum_tensor, checksum_tensors


def test_same_bytes_same_checksum_any_alignment():
    data = torch.randint(0, 256, (50_001,), dtype=torch.uint8)
    padded = torch.cat([torch.zeros(3, dtype=torch.uint8), data])
    assert checksum_bytes(data) == checksum_bytes(padded[3:])


def test_detects_a_flipped_bit_anywhere_and_moved_bytes():
    data = torch.randint(0, 256, (3 * 8192 + 17,), dtype=torch.uint8)
    base = checksum_bytes(data)
    for at in (0, 7, 8191, 8192, 20000, data.numel() - 1):
        flipped = data.clone()
        flipped[at] ^= 1
        assert checksum_bytes(flipped) != base, at
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16].clone(), data[:8].clone()
    assert checksum_bytes(swapped) != base, "moving words must change the checksum"


def test_length_is_part_of_the_checksum():
    assert checksum_bytes(torch.zeros(8, dtype=torch.uint8)) != checksum_bytes(torch.zeros(16, dtype=torch.uint8))


def test_tensor_checksum_matches_its_bytes():
    t = torch.randn(33, 7).to(torch.bfloat16)
    assert checksum_tensor(t) == checksum_tensor(t.clone())
    assert checksum_tensor(t.t()) == checksum_tensor(t.t().contiguous())
    assert checksum_tensor(torch.tensor(3.0)) != checksum_tensor(torch.tensor(4.0))
    assert checksum_tensor(torch.empty(0)).startswith("0:")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=0, max_size=3),
       st.sampled_from([torch.bfloat16, torch.float32, torch.int8]), st.integers(1, 4), st.data())
def test_the_sums_of_any_cut_of_a_tensor_add_up_to_its_checksum(shape, dtype, parts, data):
    """box_sums: a tensor cut into boxes along any dimension (as ranks hold it) checksums as the whole."""
    from rlsync.transfer.checksum import box_sums, from_sums
    from rlsync.transfer.routes import chunks, whole

    t = (torch.randn(shape) * 100).to(dtype)
    boxes = [whole(shape)]
    if shape:
        dim = data.draw(st.integers(0, len(shape) - 1))
        boxes = [tuple((a, b) if d == dim else w for d, w in enumerate(whole(shape)))
                 for a, b in chunks(shape[dim], parts) if b > a]
    s1 = s2 = 0
    for box in boxes:
        a, b = box_sums(t[tuple(slice(x, y) for x, y in box)] if box else t, box, tuple(shape))
        s1, s2 = s1 + a, s2 + b
    assert from_sums(t.numel() * t.element_size(), s1, s2) == checksum_tensor(t)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3),
       st.sampled_from([torch.bfloat16, torch.float32, torch.int8]), st.integers(1, 3), st.integers(1, 4), st.data())
def test_alike_boxes_of_many_tensors_summed_together_add_up_to_each_ones_checksum(shape, dtype, tensors, parts, data):
    """box_sums_many: the same cut of several tensors of one shape (one expert's slice of each expert), its boxes
    summed together, stacked, and in batches smaller than the boxes: each tensor's boxes add up to its checksum."""
    from rlsync.transfer import checksum
    from rlsync.transfer.routes import chunks, whole

    dim = data.draw(st.integers(0, len(shape) - 1))
    boxes = [tuple((a, b) if d == dim else w for d, w in enumerate(whole(shape)))
             for a, b in chunks(shape[dim], parts) if b > a]
    ts = [(torch.randn(shape) * 100).to(dtype) for _ in range(tensors)]
    items = [(k, box) for box in boxes for k in range(tensors)]
    for held in (checksum.BATCH_BYTES, data.draw(st.integers(1, 64))):  # (a batch a box or a few: flushed as it goes)
        sums = checksum.box_sums_many(((ts[k][tuple(slice(x, y) for x, y in box)], box, tuple(shape))
                                       for k, box in items), held_bytes=held)
        for k, t in enumerate(ts):
            mine = [s for (j, _), s in zip(items, sums) if j == k]
            s1, s2 = sum(a for a, _ in mine), sum(b for _, b in mine)
            assert checksum.from_sums(t.numel() * t.element_size(), s1, s2) == checksum_tensor(t)


@pytest.mark.parametrize("shape", [(6, 4), (128, 1024)])  # (the second: stacked into kept buffers, numpy's sums)
def test_a_kept_plan_sums_new_values_of_the_same_boxes_and_refuses_another_dtype(shape):
    """BoxSums: the plan made at the first call (which boxes are alike, where batches end) sums the next call's values
    of the same boxes: each tensor's row halves, and its three column blocks (runs that start inside a word), add up
    to its checksum (Checksums' own sums of the whole), at every call; values of another dtype are refused."""
    from rlsync.transfer.checksum import BoxSums, from_sums

    g = torch.Generator().manual_seed(5)
    rows, cols = shape
    halves = [((0, rows // 2), (0, cols)), ((rows // 2, rows), (0, cols))]
    blocks = [((0, rows), (0, 1)), ((0, rows), (1, cols // 2 + 1)), ((0, rows), (cols // 2 + 1, cols))]
    boxes = [(box, shape) for box in halves + blocks] * 3
    cut = [tuple(slice(a, b) for a, b in box) for box, _ in boxes]

    def values():
        ts = [torch.randn(shape, generator=g) for _ in range(3)]
        return ts, [ts[k // 5][c] for k, c in enumerate(cut)]

    for held in (1 << 22, 100):  # one batch; a batch every box or two
        sums = BoxSums(boxes, held_bytes=held)
        for _ in range(3):
            ts, now = values()
            got = sums(iter(now))
            for k, t in enumerate(ts):
                for part in (got[5 * k:5 * k + 2], got[5 * k + 2:5 * k + 5]):
                    s1, s2 = sum(a for a, _ in part), sum(b for _, b in part)
                    assert from_sums(t.numel() * t.element_size(), s1, s2) == checksum_tensor(t)
        with pytest.raises(ValueError, match="planned as torch.float32"):
            sums([v.double() for v in values()[1]])
        mixed = values()[1]
        mixed[5] = mixed[5].half()  # (a stack of it and float32 boxes is float32: each box is looked at)
        with pytest.raises(ValueError, match="float16"):
            sums(mixed)


def test_many_tensors_at_once_equal_one_at_a_time():
    """checksum_tensors / audit (off a GPU: one Checksums, read once) give each tensor's own checksum:
    odd sizes, unaligned and non-contiguous views, an empty tensor, mixed dtypes."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (40_000,), dtype=torch.uint8, generator=g)
    tensors = [torch.randn(300, 17, generator=g), torch.randn(64, 64, generator=g).to(torch.bfloat16).t(),
               base[3:10_003], base[8:16_008].view(torch.int64), torch.empty(0), torch.randn(5, generator=g)]
    assert checksum_tensors(tensors) == [checksum_tensor(t) for t in tensors]
    named = {f"t{k}": t for k, t in enumerate(tensors)}
    assert audit(named) == {n: audit_entry(t) for n, t in named.items()}


def test_a_kept_audit_reads_the_tensors_as_they_are_at_each_call():
    """KeptAudit (a vLLM worker's audit of its live weights after each commit): laid out once, each call
    reads the bytes as they are then, a non-contiguous view too; it fits only the same tensors where they were."""
    g = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(64, 48, generator=g), torch.randn(48, generator=g)
    named = {"w": weight, "w_t": weight.t(), "b": bias[8:40]}
    kept = KeptAudit(named)
    assert kept() == audit(named)
    weight.add_(1.0)
    bias[10] = 7.0
    assert kept() == audit(named) == {n: audit_entry(t) for n, t in named.items()}
    assert kept.fits(dict(named))
    replaced = dict(named)
    replaced["b"] = torch.randn(32, generator=g)  # another tensor in place of one: the mapping changed in place
    assert not kept.fits(replaced)
    assert not kept.fits({**named, "w": weight.view(48, 64)})  # another shape, same place
    assert not kept.fits({**named, "b": bias[9:41]})  # moved
    assert not kept.fits({**named, "b": bias[8:40].view(torch.int32)})  # another dtype
    assert not kept.fits({"b": named["b"], "w": weight, "w_t": weight.t()})  # another order


KEPT_RUN = r"""
import json, sys, torch
from rlsync.transfer import batched, checksum
checksum.CHUNK_WORDS = 100
batched.available = lambda device: True  # (the CPU as the kernel's device, under the interpreter)
g = torch.Generator().manual_seed(int(sys.argv[1]))
buf = torch.randint(-2 ** 62, 2 ** 62, (2_000,), dtype=torch.int64, generator=g)
grid = torch.randn(40, 24, generator=g)
raw = buf.view(torch.uint8)
tensors = [buf[1:700], buf[700:701], buf[701:1999], grid.t(), raw[3:1003], torch.empty(0)]  # a transposed view,
# an unaligned one and an empty one are summed apart, anew at each call
kept = checksum.KeptSums(tensors, 3)
first = kept() == [checksum.checksum_tensor(t) for t in tensors]
buf[5:900] += 3
grid[2] = 0.5
print(json.dumps({"exact": first and kept() == [checksum.checksum_tensor(t) for t in tensors],
                  "in_kernel": sum(len(at) for _, at in kept.launches)}))
"""


def test_kept_sums_read_the_tensors_anew_at_each_call_under_tritons_interpreter():
    """KeptSums laid out once (the kernel's table for the aligned tensors; the rest apart) sums the bytes as they
    are at each call, its sums zeroed first (the kernel adds into them)."""
    got = interpreted(KEPT_RUN, 0)
    assert got["exact"] and got["in_kernel"] == 3


SUMS_RUN = r"""
import json, sys, numpy as np, torch
from rlsync.transfer import checksum
checksum.CHUNK_WORDS = 100  # many chunks per tensor, and partial ones
g = torch.Generator().manual_seed(int(sys.argv[1]))
words = [int(n) for n in torch.randint(1, 700, (12,), generator=g)]
buf = torch.randint(-2 ** 62, 2 ** 62, (sum(words) + 8,), dtype=torch.int64, generator=g)
buf[:4] = torch.tensor([-1, 2 ** 63 - 1, -2 ** 63, 7])  # sums that wrap
views, at = [], 1
for n in words:
    views.append(buf[at:at + n])
    at += n
rows = np.array([(v.data_ptr(), v.numel(), k) for k, v in enumerate(views)], dtype=np.int64)
got = [f"{8 * n:x}:{a & checksum._MASK:016x}:{b & checksum._MASK:016x}"
       for n, (a, b) in zip(words, checksum._ChunkSums(rows, torch.device("cpu"), [None, 3][int(sys.argv[1]) % 2])())]
print(json.dumps({"exact": got == [checksum.checksum_tensor(v) for v in views]}))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_the_checksum_kernel_sums_as_the_torch_path_does_under_tritons_interpreter(seed):
    """The one-launch kernel of checksum_tensors (batched_kernel.checksum_chunks), run on the CPU by
    Triton's interpreter: every tensor's two sums modulo 2^64 equal checksum_tensor's, chunks cut anywhere,
    with a program per chunk (seed 0) and with three programs striding over them (seed 1: a live audit's)."""
    assert interpreted(SUMS_RUN, seed)["exact"]
