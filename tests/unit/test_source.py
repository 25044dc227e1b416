"""Transfer sources: streamed passes produce every tensor once, in order, whatever the reader skips."""

from __future__ import annotations

import pytest
import torch

from rlsync.errors import InvalidArgument
from rlsync.transfer.manifest import Spec
from rlsync.transfer.source import ResidentSource, StreamedSource

TENSORS = [torch.arange(6, dtype=torch.float32).view(2, 3), torch.zeros(0), torch.ones(4, dtype=torch.bfloat16)]


def source(produced: list[int], tensors=TENSORS) -> StreamedSource:
    specs = [Spec.of(f"t{i}", t) for i, t in enumerate(TENSORS)]

    def produce(i):
        produced.append(i)
        return tensors[i]

    return StreamedSource(specs, torch.device("cpu"), produce)


def test_a_pass_produces_each_tensor_once_in_order_even_when_the_reader_skips():
    produced = []
    p = source(produced).stream()
    assert torch.equal(p[0], TENSORS[0].view(-1).view(torch.uint8))
    assert p[0] is p[0], "the current tensor is kept while it is read"
    assert torch.equal(p[2], TENSORS[2].view(torch.uint8))  # tensor 1 (zero bytes) is produced in between
    assert produced == [0, 1, 2]
    with pytest.raises(RuntimeError, match="in order"):
        p[1]
    p.finish()
    assert produced == [0, 1, 2], "finish produces only what is left"


def test_finish_completes_a_pass_that_stopped_early():
    produced = []
    s = source(produced)
    p = s.stream()
    p[0]
    p.finish()
    assert produced == [0, 1, 2] and s.passes == 1


def test_checksums_in_specs_take_one_pass_and_match_the_tensors():
    produced = []
    s = source(produced)
    specs = s.specs(checksums=True)
    assert produced == [0, 1, 2]
    assert [x.checksum for x in specs] == [Spec.of("x", t, True).checksum for t in TENSORS]


def test_a_tensor_produced_unlike_its_spec_is_refused():
    wrong = [TENSORS[0].double(), TENSORS[1], TENSORS[2]]
    with pytest.raises(InvalidArgument, match="'t0' was described as float32"):
        source([], wrong).stream()[0]


def test_a_module_published_in_another_dtype_offers_its_parameters_to_cast_on_the_way():
    """fp32 parameters published as bf16: the source keeps the parameters themselves (a receiver on
    their GPU maps them and casts as it copies); fusing two into one leaves nothing to map."""
    from torch import nn

    from rlsync.publish import WeightMap
    from rlsync.publish.source import module_source

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 3))
    cast, _ = module_source(model, WeightMap(dtype=torch.bfloat16))
    assert [t.data_ptr() for t in cast.originals] == [p.data_ptr() for p in model.parameters()]
    assert [s.dtype for s in cast.specs()] == [torch.bfloat16] * 4
    fused, _ = module_source(model, WeightMap(dtype=torch.bfloat16, fuse={"w": ["0.weight", "1.weight"]}))
    assert fused.originals is None
    with pytest.raises(InvalidArgument, match="originals"):
        StreamedSource(cast.specs(), torch.device("cpu"), lambda i: None, originals=cast.originals[:1])


def test_a_resident_source_describes_its_tensors_once_and_checksums_their_values_each_time():
    tensors = {f"t{i}": t.clone() for i, t in enumerate(TENSORS)}
    s = ResidentSource(tensors)
    assert s.specs() is s.specs() and s.specs() == [Spec.of(n, t) for n, t in tensors.items()]
    before = [x.checksum for x in s.specs(checksums=True)]
    tensors["t2"].add_(1)  # a training step: the values change, the layout does not
    after = [x.checksum for x in s.specs(checksums=True)]
    assert before[:2] == after[:2] and before[2] != after[2]
    assert after == [Spec.of(n, t, True).checksum for n, t in tensors.items()]
