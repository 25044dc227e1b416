"""The gateway's resubmission requests are built from a copy; the caller's request never changes."""

from rlsync.common.v1 import generate_pb2 as pb
from rlsync.coordinator.config import CoordinatorConfig
from rlsync.coordinator.gateway import Gateway


def test_resubmission_continues_from_the_tokens_so_far_without_touching_the_original():
    base = pb.GenerateRequest(request_id="r", text="hello", sampling=pb.SamplingParams(max_tokens=10, n=3, seed=5))
    original = base.SerializeToString()
    gw = Gateway(registry=None, syncer=None, cfg=CoordinatorConfig())
    first = gw._sub_request(base, index=1, n=3, attempt=0, prompt=None, produced=[])
    again = gw._sub_request(base, index=1, n=3, attempt=2, prompt=[7, 8], produced=[1, 2, 3])
    assert base.SerializeToString() == original
    assert (first.text, first.sampling.n, first.sampling.seed, first.sampling.max_tokens) == ("hello", 1, 6, 10)
    assert list(again.token_ids.ids) == [7, 8, 1, 2, 3] and again.sampling.max_tokens == 7
    assert again.request_id == "r:1:2"
