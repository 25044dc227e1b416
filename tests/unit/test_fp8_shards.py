"""Block FP8 across row shards: the plan (which block rows two ranks cut, who sends which scale row) and,
with real torch.distributed (gloo, 2 ranks, separate processes), the per-rank result equal bit for bit
to the reference quantizer of the whole tensor."""

from __future__ import annotations

from pathlib import Path

from conftest import two_gloo_ranks
from rlsync.quant.fp8_shards import fsdp_row_ranges, owned_block_rows, shared_block_rows

WORKER = Path(__file__).parent.parent / "fp8_shard_worker.py"


def test_plan_names_the_cut_blocks_and_one_owner_per_scale_row():
    ranges = fsdp_row_ranges(300, 2)  # rows 0..149 and 150..299: block row 1 (128..255) is cut
    assert ranges == [(0, 150), (150, 300)]
    assert shared_block_rows(ranges) == [1]
    assert [list(owned_block_rows(ranges, r)) for r in range(2)] == [[0, 1], [2]]
    assert shared_block_rows(fsdp_row_ranges(256, 2)) == []  # shards on block boundaries: no exchange
    assert shared_block_rows(fsdp_row_ranges(1, 2)) == [] and list(owned_block_rows(fsdp_row_ranges(1, 2), 1)) == []
    ranges = fsdp_row_ranges(520, 4)  # 130 rows each: every boundary cuts a block
    owners = [list(owned_block_rows(ranges, r)) for r in range(4)]
    assert sorted(b for o in owners for b in o) == list(range(5))


def test_two_gloo_ranks_quantize_their_shards_as_the_whole_tensor_bit_for_bit():
    two_gloo_ranks(WORKER, results=12)
