"""The rollout gRPC API against real servers (separate processes), for both engines on the tiny model."""

from __future__ import annotations

import time

import grpc
import pytest

from conftest import engines, rollout_args
from rlsync.client import RolloutClient, RpcError
from streams import Stream, frozen_streams, wait_in_flight


@pytest.fixture(scope="module", params=engines("hf", "vllm", "sglang"))
def rollout(request, module_services) -> RolloutClient:
    proc = module_services.start("rollout", rollout_args(request.param), name=f"rollout-{request.param}")
    with RolloutClient(proc.address) as client:
        client.engine = request.param
        yield client


LONG = dict(max_tokens=900, ignore_eos=True, temperature=1.0)


@pytest.fixture(autouse=True)
def serving_again(rollout):
    """A test that fails while the replica is paused or asleep must not leave it so for the next one."""
    yield
    rollout.wake_up()
    rollout.resume()


def test_generation_streams_tokens_tagged_with_version(rollout):
    chunks = list(rollout.generate("the model reads", max_tokens=12, ignore_eos=True, logprobs=True))
    assert len(chunks) > 1, "expected a stream of several chunks"
    assert chunks[0].prompt_token_ids, "first chunk carries the prompt ids"
    assert all(c.weight_version == 0 for c in chunks)
    final = chunks[-1]
    assert final.finish_reason == 2  # LENGTH
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [x for c in chunks for x in c.logprobs]
    assert len(tokens) == 12 and len(logprobs) == 12 and all(x <= 0 for x in logprobs)
    assert [(s.weight_version, s.start, s.length) for s in final.version_spans] == [(0, 0, 12)]
    assert (final.min_weight_version, final.max_weight_version) == (0, 0)
    assert "".join(c.text for c in chunks)


def test_greedy_is_deterministic(rollout):
    a = rollout.complete("3+4=", max_tokens=24, temperature=0, ignore_eos=True)[0]
    b = rollout.complete("3+4=", max_tokens=24, temperature=0, ignore_eos=True)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_seed_reproduces_and_differs(rollout):
    kw = dict(max_tokens=24, temperature=1.0, ignore_eos=True)
    if rollout.engine == "sglang":
        pytest.skip("SGLang applies seeds only with deterministic inference, which its CPU attention backend lacks")
    a = rollout.complete("alpha beta", seed=7, **kw)[0]
    b = rollout.complete("alpha beta", seed=7, **kw)[0]
    c = rollout.complete("alpha beta", seed=8, **kw)[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_n_completions_stream_under_their_index(rollout):
    out = rollout.complete([5, 6, 7], n=3, max_tokens=8, temperature=1.0, ignore_eos=True)
    assert [c.index for c in out] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out)
    assert len({tuple(c.token_ids) for c in out}) > 1, "sampled completions should differ"


def test_stop_string_ends_completion_and_is_not_returned(rollout):
    free = rollout.complete("the model", max_tokens=30, temperature=0, ignore_eos=True)[0]
    assert len(free.text) > 8
    stop = free.text[4:7]
    out = rollout.complete("the model", max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])[0]
    assert out.finish_reason == "stop" and stop in out.finish_detail
    assert out.text == free.text[:free.text.find(stop)]


def test_abort_ends_one_stream_with_partial_tokens_others_run_on(rollout):
    a, b = frozen_streams(rollout, ["alpha", "beta"], **LONG)
    rollout.abort(a.request_id)
    rollout.resume()
    a.thread.join(30)
    b.thread.join(60)
    final_a = a.chunks[-1]
    assert final_a.finish_reason == 3 and "Abort" in final_a.finish_detail  # ABORT
    assert 0 < a.tokens < LONG["max_tokens"]
    assert b.chunks[-1].finish_reason == 2
    assert b.tokens == LONG["max_tokens"]


def test_abort_unknown_request_is_not_found(rollout):
    with pytest.raises(RpcError) as e:
        rollout.abort("no-such-request")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "no-such-request" in e.value.message


def _settled(s: Stream, quiet: float = 1.0, timeout: float = 30.0) -> int:
    """The stream's chunk count once no chunk arrived for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = len(s.chunks)
        time.sleep(quiet)
        if len(s.chunks) == seen:
            return seen
    raise AssertionError(f"chunks kept arriving for {timeout}s")


def test_pause_keep_freezes_and_resume_continues_same_stream(rollout):
    (s,) = frozen_streams(rollout, ["gamma"], **LONG)  # paused with KEEP while the stream runs
    frozen_at = _settled(s)  # chunks made before the pause may still be on the way
    time.sleep(1.0)
    assert len(s.chunks) == frozen_at, "no token may be produced while paused with KEEP"
    info = rollout.info()
    assert info.state == 2 and info.in_flight == 1  # PAUSED
    rollout.resume()
    s.thread.join(120)
    assert s.chunks[-1].finish_reason == 2
    assert s.tokens == LONG["max_tokens"]


def test_pause_abort_ends_streams_and_new_requests_wait_for_resume(rollout):
    streams = frozen_streams(rollout, ["one", "two"], **LONG)
    resp = rollout.pause("abort")
    assert resp.aborted == 2
    for s in streams:
        s.thread.join(30)
        final = s.chunks[-1]
        assert final.finish_reason == 3 and "Pause(ABORT)" in final.finish_detail
        assert 0 < s.tokens < LONG["max_tokens"]
    waiting = Stream(rollout, "three", max_tokens=5, ignore_eos=True)
    time.sleep(0.5)
    assert not waiting.chunks, "a request sent while paused waits for Resume"
    rollout.resume()
    waiting.thread.join(30)
    assert waiting.chunks[-1].finish_reason == 2


def test_pause_wait_lets_requests_finish(rollout):
    s = Stream(rollout, "delta", max_tokens=200, ignore_eos=True)
    assert s.first.wait(30)
    resp = rollout.pause("wait")
    assert resp.in_flight == 0
    s.thread.join(30)
    assert s.chunks[-1].finish_reason == 2
    assert s.tokens == 200
    rollout.resume()
    assert rollout.info().state == 1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt="hi", max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens must be >= 1"),
    (dict(prompt="hi", max_tokens=5000), "exceeds the model's context"),
    (dict(prompt="hi", n=0), "n must be >= 1"),
    (dict(prompt="hi", n=2, temperature=0), "n must be 1 with temperature 0"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt=[1, 99999]), "outside the vocabulary"),
    (dict(prompt="hi", stop=[""]), "stop strings"),
])
def test_bad_generate_input_is_invalid_argument(rollout, kwargs, fragment):
    kwargs = dict(kwargs)  # the parameter dict is shared by both engines' runs
    prompt = kwargs.pop("prompt")
    with pytest.raises(RpcError) as e:
        rollout.complete(prompt, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in e.value.message


def test_duplicate_request_id_is_refused(rollout):
    rollout.pause("keep")  # the first request stays in flight, deterministically
    s = Stream(rollout, "dup", request_id="same-id", **LONG)
    wait_in_flight(rollout, 1)
    with pytest.raises(RpcError) as e:
        rollout.complete("dup", request_id="same-id", max_tokens=4)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    rollout.abort("same-id")
    rollout.resume()
    s.thread.join(30)


def test_oversized_message_is_refused_and_service_stays_up(rollout):
    with pytest.raises(RpcError) as e:
        rollout.complete("x" * (17 << 20), max_tokens=1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rollout.complete("still up", max_tokens=3, ignore_eos=True)[0].finish_reason == "length"


def test_pause_without_mode_is_invalid(rollout):
    from rlsync.rollout.v1 import rollout_pb2 as pb

    with pytest.raises(grpc.RpcError) as e:
        rollout.stub.Pause(pb.PauseRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sleep_refuses_generate_and_wake_up_restores_same_output(rollout):
    before = rollout.complete("sleepy", max_tokens=16, temperature=0, ignore_eos=True)[0]
    rollout.sleep(level=1)
    assert rollout.info().state == 3  # SLEEPING
    with pytest.raises(RpcError) as e:
        rollout.complete("sleepy", max_tokens=4)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in e.value.message
    rollout.wake_up("weights")
    assert rollout.info().state == 3, "kv_cache still asleep"
    rollout.wake_up()
    rollout.wake_up()  # a second WakeUp is a no-op
    assert rollout.info().state == 1
    after = rollout.complete("sleepy", max_tokens=16, temperature=0, ignore_eos=True)[0]
    assert after.token_ids == before.token_ids


def test_bad_sleep_level_is_invalid(rollout):
    with pytest.raises(RpcError) as e:
        rollout.sleep(level=3)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
