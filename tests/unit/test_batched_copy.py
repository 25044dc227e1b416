"""Many copies in one kernel launch (rlsync.transfer.batched): the table of chunks covers every byte
of every copy in order (property-tested), pairs the kernel cannot take are left to the caller, and
the kernel itself, run by Triton's interpreter on the CPU, lands every byte of scattered layouts."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import interpreted
from rlsync.transfer import batched

pytest.importorskip("triton")


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 300).map(lambda n: n * 16), min_size=1, max_size=20),
       chunk=st.sampled_from([16, 48, 64, 1024]))
def test_chunks_cover_every_byte_of_every_row_in_order_and_none_is_larger_than_a_chunk(sizes, chunk):
    starts = np.cumsum([0, *sizes])[:-1]
    rows = np.array([(1 << 20) + starts, (1 << 30) + 2 * starts, sizes], dtype=np.int64).T.reshape(-1, 3)
    out = batched.chunks(rows, chunk)
    assert (out[:, 2] <= chunk).all() and (out[:, 2] > 0).all()
    covered = [(int(s), int(d), int(n)) for s, d, n in out]
    expected = [(int(s) + o, int(d) + o, min(chunk, int(n) - o)) for s, d, n in rows for o in range(0, int(n), chunk)]
    assert covered == expected


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40).map(lambda n: n * 4096), min_size=1, max_size=5), data=st.data())
def test_a_rebased_table_reads_the_same_offsets_of_the_regions_mapped_anew(sizes, data):
    old = np.array([(1 << 30) * (i + 1) for i in range(len(sizes))], dtype=np.int64)
    new = np.array(data.draw(st.permutations([(1 << 34) + (1 << 31) * i for i in range(len(sizes))])), dtype=np.int64)
    reads = [(r, o, n) for r, size in enumerate(sizes)  # a few copies out of each region, at its own offsets
             for o, n in data.draw(st.lists(st.tuples(st.integers(0, size // 16 - 1).map(lambda k: k * 16),
                                                      st.just(16)), max_size=4))]
    rows = np.array([(old[r] + o, (1 << 40) + 64 * i, n) for i, (r, o, n) in enumerate(reads)],
                    dtype=np.int64).reshape(-1, 3)
    table = batched.Table(torch.from_numpy(rows), False, rows)
    moved = batched.rebased(table, old, new)
    assert moved.host.tolist() == [[int(new[r] + o), (1 << 40) + 64 * i, n] for i, (r, o, n) in enumerate(reads)]
    assert moved.rows.tolist() == moved.host.tolist() and table.host.tolist() == rows.tolist()
    woken = batched.rebased(moved, new, new, dst=(np.array([1 << 40]), np.array([1 << 41])))  # the destination moved
    assert woken.host.tolist() == [[int(new[r] + o), (1 << 41) + 64 * i, n] for i, (r, o, n) in enumerate(reads)]


def test_split_leaves_pairs_the_kernel_cannot_take_to_the_caller():
    buf, out = torch.empty(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    base = (-buf.data_ptr()) % 16
    aligned = (buf[base:base + 64], out[(-out.data_ptr()) % 16:][:64])
    odd_size = (buf[base:base + 40], out[:40])
    odd_address = (buf[base + 1:base + 65], out[(-out.data_ptr()) % 16:][:64])
    rows, rest = batched.split([aligned, odd_size, odd_address])
    assert rows.tolist() == [[aligned[0].data_ptr(), aligned[1].data_ptr(), 64]]
    assert [(a.data_ptr(), b.data_ptr(), a.numel()) for a, b in rest] == [
        (a.data_ptr(), b.data_ptr(), a.numel()) for a, b in (odd_size, odd_address)]


KERNEL_RUN = r"""
import json, sys, torch
from rlsync.transfer import batched
from rlsync.transfer.spans import copy_all
batched.CHUNK = 256  # many chunks per copy, and tails
g = torch.Generator().manual_seed(int(sys.argv[1]))
sizes = [int(n) for n in torch.randint(0, 120, (30,), generator=g) * 8]  # some not multiples of 16
src_buf = torch.randint(0, 256, (sum(sizes) + 4096,), dtype=torch.uint8, generator=g)
dst_buf = torch.zeros(sum(sizes) * 2 + 4096, dtype=torch.uint8)
pairs, s, d = [], 16 - src_buf.data_ptr() % 16, 16 - dst_buf.data_ptr() % 16
for n in sizes:  # scattered on both sides: every copy its own place, gaps between
    pairs.append((src_buf[s:s + n], dst_buf[d:d + n]))
    s, d = s + n, d + n + 16 * int(torch.randint(0, 3, (1,), generator=g))
rows, rest = batched.split(pairs)
batched.launch(batched.table(rows, torch.device("cpu")))
copy_all(rest, one_launch=False)
print(json.dumps({"exact": all(torch.equal(a, b) for a, b in pairs), "kernel": len(rows), "rest": len(rest),
                  "untouched": int(dst_buf.count_nonzero()) == sum(int(a.count_nonzero()) for a, _ in pairs)}))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_the_kernel_lands_every_byte_of_a_scattered_layout_under_tritons_interpreter(seed):
    got = interpreted(KERNEL_RUN, seed)
    assert got["exact"] and got["untouched"], got
    assert got["kernel"] > 0 and got["rest"] > 0, f"both paths must run: {got}"


CAST_RUN = r"""
import json, sys, torch
from rlsync.transfer import batched
from rlsync.transfer.spans import cast_all
batched.CAST_CHUNK = 64  # many chunks per tensor, and tails
g = torch.Generator().manual_seed(int(sys.argv[1]))
counts = [int(n) for n in torch.randint(0, 90, (20,), generator=g) * 2]  # some not multiples of 4
src = torch.randn(sum(counts) + 64, generator=g) * 100
src[:8] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1e-40, -1e-39, 3e38, 0.0, -0.0])  # ties, tiny
dst = torch.zeros(sum(counts) * 2 + 64, dtype=torch.bfloat16)
pairs, s, d = [], (-src.data_ptr() % 16) // 4, (-dst.data_ptr() % 8) // 2
for n in counts:  # scattered on both sides
    pairs.append((src[s:s + n], dst[d:d + n]))
    s, d = s + n + 4 * (n % 3 == 0), d + n + 4
rows, rest = batched.split(pairs, cast=True)
batched.launch(batched.table(rows, torch.device("cpu"), cast=True))  # the kernel, interpreted
for a, b in rest:
    b.copy_(a)
print(json.dumps({"exact": all(torch.equal(b.view(torch.int16), a.to(torch.bfloat16).view(torch.int16))
                                for a, b in pairs), "kernel": len(rows), "rest": len(rest),
                  "cast_all_off_gpu": cast_all(pairs) is None}))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_the_cast_kernel_rounds_as_torch_does_under_tritons_interpreter(seed):
    """fp32 -> bf16 in one launch, bit for bit as torch's own cast (ties to even, subnormals, signs)."""
    got = interpreted(CAST_RUN, seed)
    assert got["exact"] and got["kernel"] > 0 and got["rest"] > 0 and got["cast_all_off_gpu"], got
