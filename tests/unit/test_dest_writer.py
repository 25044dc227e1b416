"""DestWriter over an engine's flat weights: a FlatStore laid out as the manifest is taken whole,
without looking at any tensor; any other layout falls back to per-tensor destinations."""

import pytest
import torch

from rlsync.flat import FlatStore
from rlsync.transfer.manifest import Spec
from rlsync.transfer.writer import DestWriter

SHAPES = {"a": (3, 4), "b": (5,), "empty": (0, 2), "c": (2, 2, 2)}


def _store(shapes, dtypes=None):
    return FlatStore({n: (torch.Size(s), (dtypes or {}).get(n, torch.bfloat16)) for n, s in shapes.items()})


def _specs(store: FlatStore, order) -> list[Spec]:
    return [Spec.of(n, store.views[n]) for n in order]


def _sent(specs):
    return {s.name: torch.randn(s.shape).to(s.dtype) for s in specs}


def test_a_store_laid_out_as_the_manifest_is_one_buffer():
    store = _store(SHAPES)
    specs = _specs(store, SHAPES)
    writer = DestWriter(specs, store, torch.device("cpu"))
    assert writer.whole is not None and writer.whole.data_ptr() == store.buffers[torch.bfloat16].data_ptr()
    assert "tensors" not in vars(writer), "no per-tensor work for a flat store"
    sent = _sent(specs)
    writer.write_whole(torch.cat([sent[s.name].reshape(-1) for s in specs]).view(torch.uint8))
    assert writer.finish() == sum(s.nbytes for s in specs)
    assert all(torch.equal(store.views[n], t) for n, t in sent.items())


def test_another_order_or_mixed_dtypes_fall_back_to_each_tensor():
    for store, order in ((_store(SHAPES), ["c", "a", "empty", "b"]),
                         (_store(SHAPES, {"b": torch.float32}), list(SHAPES))):
        specs = _specs(store, order)
        writer = DestWriter(specs, store, torch.device("cpu"))
        assert writer.whole is None and all(writer.direct)
        sent = _sent(specs)
        for i, s in enumerate(specs):
            writer.write(i, 0, sent[s.name].reshape(-1).view(torch.uint8))
        assert writer.finish() == sum(s.nbytes for s in specs)
        assert all(torch.equal(store.views[n], t) for n, t in sent.items())


def test_tensors_sent_in_another_dtype_are_cast_as_they_are_written():
    """A pull that casts (fp32 at the sender, bf16 in the manifest): each tensor lands as the sender's own
    cast would make it, in place or through the buffer of a destination in a third dtype."""
    from rlsync.errors import DataLoss

    store = _store(SHAPES, {"b": torch.float16})
    specs = [Spec(s.name, torch.bfloat16, s.shape, s.nbytes // s.dtype.itemsize * 2) for s in _specs(store, SHAPES)]
    sent = {s.name: torch.randn(s.shape) * 3 for s in specs}
    writer = DestWriter(specs, store, torch.device("cpu"))
    writer.write_cast([sent[s.name].reshape(-1) if s.nbytes else None for s in specs])
    assert writer.finish() == sum(s.nbytes for s in specs)
    assert all(torch.equal(store.views[n], t.to(torch.bfloat16).to(store.views[n].dtype)) for n, t in sent.items())
    short = DestWriter(specs, store, torch.device("cpu"))
    with pytest.raises(DataLoss, match="'a': 11 elements sent"):
        short.write_cast([torch.zeros(11)] + [None] * (len(specs) - 1))
