"""What a pull derives from the sender's regions (rlsync.transfer.backends.slots._Layout): each
tensor's bytes, or its elements in the dtype the sender keeps them in (a pull that casts)."""

import pytest
import torch

from rlsync.errors import DataLoss
from rlsync.transfer.backends.slots import _Layout
from rlsync.transfer.manifest import Spec

SPECS = [Spec("a", torch.bfloat16, (2, 3), 12), Spec("empty", torch.bfloat16, (0,), 0),
         Spec("b", torch.bfloat16, (4,), 8)]


def test_a_layout_reads_each_tensor_in_the_senders_dtype():
    values = torch.arange(10, dtype=torch.float32)
    regions = [values.view(torch.uint8)]
    layout = _Layout(SPECS, [(0, 0), (0, 0), (0, 24)], regions, {})
    a, empty, b = layout.typed(["float32"] * 3)
    assert torch.equal(a, values[:6]) and empty is None and torch.equal(b, values[6:])
    assert layout.typed(["float32"] * 3)[0] is a, "kept for the same dtypes"
    here = [(0, 0), (0, 0), (0, 24)]
    assert layout.serves(list(SPECS), here, regions) and layout.serves(SPECS, here, list(regions))
    assert not layout.serves(SPECS, [(0, 0), (0, 0), (0, 8)], regions), "other places"
    assert not layout.serves(SPECS, here, [values.clone().view(torch.uint8)]), "another mapping at the same places"
    fp16 = [Spec(s.name, torch.float16, s.shape, s.nbytes) for s in SPECS]
    assert not layout.serves(fp16, here, regions), "the same sizes in another dtype"


def test_a_tensor_that_does_not_fit_its_region_is_refused():
    regions = [torch.zeros(30, dtype=torch.uint8)]
    with pytest.raises(DataLoss, match="'b': 16 bytes at byte 24 of region 0 lie outside"):
        _Layout(SPECS, [(0, 0), (0, 0), (0, 24)], regions, None).typed(["float32"] * 3)
    with pytest.raises(DataLoss, match="'b': 8 bytes at byte 24 of region 0 lie outside"):
        assert _Layout(SPECS, [(0, 0), (0, 0), (0, 24)], [torch.zeros(28, dtype=torch.uint8)], None).sources
    with pytest.raises(DataLoss, match="'b': 8 bytes at byte 0 of region -1"):
        assert _Layout(SPECS, [(0, 0), (0, 0), (-1, 0)], regions, None).sources
    with pytest.raises(DataLoss, match="'the tensors': 20 bytes at byte 16 of region 0"):
        _Layout(SPECS, [(0, 16), (0, 0), (0, 28)], regions, None)  # back to back, past the end
