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
    assert layout.serves(list(SPECS), [(0, 0), (0, 0), (0, 24)]) and not layout.serves(SPECS, [(0, 0), (0, 0), (0, 8)])


def test_a_tensor_that_does_not_fit_its_region_is_refused():
    regions = [torch.zeros(30, dtype=torch.uint8)]
    with pytest.raises(DataLoss, match="'b': 4 float32 elements at byte 24"):
        _Layout(SPECS, [(0, 0), (0, 0), (0, 24)], regions, None).typed(["float32"] * 3)
