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


class _Replica:
    """A member whose stream fails before its first chunk (dead replica), or streams `chunks`."""

    def __init__(self, name: str, chunks: list | None):
        from types import SimpleNamespace

        self.name, self.in_flight, self._chunks = name, 0, chunks
        self.client = SimpleNamespace(stream=self.stream)

    async def stream(self, req):
        import grpc

        from rlsync.client import RpcError

        if self._chunks is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        for c in self._chunks:
            yield c


def test_the_caller_gets_its_prompt_ids_when_the_first_replica_died_before_any_chunk():
    import asyncio

    prompt = [5, 6, 7]
    chunks = [pb.GenerateChunk(prompt_token_ids=prompt, token_ids=[1], weight_version=3),
              pb.GenerateChunk(token_ids=[2], weight_version=3, finish_reason=pb.FINISH_REASON_LENGTH,
                               version_spans=[pb.VersionSpan(weight_version=3, start=0, length=2)])]
    replicas = iter([_Replica("dead", None), _Replica("alive", chunks)])
    gw = Gateway(registry=None, syncer=None, cfg=CoordinatorConfig())

    async def pick(session, avoid=frozenset()):
        return next(replicas)

    gw._pick = pick
    out: asyncio.Queue = asyncio.Queue()
    base = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(max_tokens=2))
    asyncio.run(gw._run_completion(base, 0, 1, out))
    got = [out.get_nowait() for _ in range(out.qsize())]
    assert [list(c.prompt_token_ids) for c in got] == [prompt, []], "once, on the first chunk the caller receives"
    assert [t for c in got for t in c.token_ids] == [1, 2] and got[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_an_engine_fault_in_every_attempt_is_passed_on_after_a_few_and_giving_up_says_what_cut_it_short():
    """A replica that fails every request alike with an internal error (an engine that cannot generate) is
    retried max_internal_resubmissions times, then its error is passed on as it is; replicas lost while they
    generate (UNAVAILABLE) are resubmitted up to max_resubmissions, and giving up names the last cause."""
    import asyncio
    from dataclasses import replace
    from types import SimpleNamespace

    import grpc
    import pytest

    from rlsync.client import RpcError

    class Broken(_Replica):
        async def stream(self, req):
            raise RpcError(grpc.StatusCode.INTERNAL, "ValueError: This model does not support generation")
            yield

    broken = Broken("r0", None)
    broken.id, broken.suspect = "r0", False
    registry = SimpleNamespace(rollouts=lambda state: [broken])
    picked = []

    async def pick(session, avoid=frozenset()):
        picked.append(avoid)
        return broken

    base = pb.GenerateRequest(request_id="r", text="hi", sampling=pb.SamplingParams(max_tokens=2))
    gw = Gateway(registry=registry, syncer=None, cfg=CoordinatorConfig())
    gw._pick = pick
    with pytest.raises(RpcError) as failed:
        asyncio.run(gw._run_completion(base, 0, 1, asyncio.Queue()))
    assert failed.value.code == grpc.StatusCode.INTERNAL and "does not support generation" in failed.value.message
    assert picked == [frozenset()] + [frozenset({"r0"})] * CoordinatorConfig().max_internal_resubmissions

    alive = SimpleNamespace(id="r1", suspect=False)  # another replica: the next attempts go there
    gw.registry = SimpleNamespace(rollouts=lambda state: [broken, alive])
    assert gw._ready(frozenset({"r0"})) == [alive] and gw._ready(frozenset({"r0", "r1"})) == [broken, alive]

    gw = Gateway(registry=None, syncer=None, cfg=replace(CoordinatorConfig(), max_resubmissions=2))
    gw._pick = lambda session, avoid: asyncio.sleep(0, _Replica("lost", None))  # UNAVAILABLE every time
    with pytest.raises(Exception, match=r"cut short 3 times; giving up \(last: replica lost answered UNAVAILABLE: "
                                        r"connection refused\)"):
        asyncio.run(gw._run_completion(base, 0, 1, asyncio.Queue()))
