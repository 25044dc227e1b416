"""The OpenAI-compatible HTTP API, with the official `openai` client against a real coordinator,
trainer and hf replica (separate processes): completions, chat, streaming, logprobs and token
ids, versions per span across an update in the middle of a streamed answer, the bearer token,
and bad parameters refused with the field named."""

from __future__ import annotations

import time

import openai
import pytest

from conftest import rollout_args
from rlsync.client import CoordinatorClient, trajectory

TOKEN = "s3cret"
MODEL = "rlsync"


@pytest.fixture(scope="module")
def fleet(module_services):
    co = module_services.start("coordinator", ["--http-port", "0", "--token", TOKEN], name="http-coordinator")
    module_services.start("trainer", ["--coordinator", co.address, "--token", TOKEN], name="http-trainer")
    module_services.start("rollout", [*rollout_args("hf"), "--coordinator", co.address, "--token", TOKEN],
                          name="http-rollout")
    grpc_client = CoordinatorClient(co.address, token=TOKEN)
    grpc_client.wait_ready(2)
    http = openai.OpenAI(base_url=f"http://{co.http_address()}/v1", api_key=TOKEN, max_retries=0)
    return http, grpc_client


def test_models_and_a_completion_with_logprobs_token_ids_and_versions(fleet):
    http, grpc_client = fleet
    assert [m.id for m in http.models.list().data] == [MODEL]
    out = http.completions.create(model=MODEL, prompt="3+4=", max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    ext = choice.model_extra["rlsync"]
    same = grpc_client.complete("3+4=", max_tokens=8, temperature=0, ignore_eos=True)[0]  # greedy: the same tokens
    assert ext["token_ids"] == same.token_ids and choice.text == same.text
    assert ext["prompt_token_ids"] == same.prompt_token_ids
    assert len(choice.logprobs.token_logprobs) == 8 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert sum(s["length"] for s in ext["weight_version_spans"]) == 8 and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == len(same.prompt_token_ids)


def test_chat_whole_and_streamed_give_the_same_answer(fleet):
    http, _ = fleet
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "3+4="}]
    args = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = http.chat.completions.create(**args, logprobs=True)
    assert whole.choices[0].message.role == "assistant" and len(whole.choices[0].logprobs.content) == 12
    chunks = list(http.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert all("weight_version" in c.choices[0].model_extra["rlsync"] for c in deltas)
    assert deltas[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12


def test_an_update_mid_stream_is_one_uninterrupted_answer_with_versions_per_span(fleet):
    """On a busy machine a stream can finish before the sync lands (its one span is then the old
    version): then it is all done again, as test_inflight does."""
    http, grpc_client = fleet
    for attempt in range(4):
        stream = http.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count:"}],
                                              max_tokens=600, temperature=1.0, seed=3 + attempt, stream=True,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = [next(stream)]
        before = grpc_client.status().weight_version
        done = grpc_client.complete("3+4=", n=4, max_tokens=8, logprobs=True, seed=1)
        grpc_client.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])
        sync = grpc_client.sync_weights(verify=True)  # the replica pauses, commits, resumes; the gateway resubmits
        chunks += list(stream)
        final = chunks[-1].choices[0]
        spans = final.model_extra["rlsync"]["weight_version_spans"]
        tokens = [t for c in chunks for t in c.choices[0].model_extra["rlsync"]["token_ids"]]
        assert final.finish_reason == "length" and len(tokens) == 600
        assert sync.verified and spans[0]["weight_version"] == before, spans
        if len(spans) > 1:
            break
    assert [s["weight_version"] for s in spans] == [before, sync.version], f"each stream ended before its sync: {spans}"
    assert sum(s["length"] for s in spans) == 600 and spans[1]["start"] == spans[0]["length"]


def test_a_wrong_token_is_401(fleet):
    http, _ = fleet
    wrong = http.with_options(api_key="nope")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert e.value.status_code == 401 and "bearer token" in e.value.message


@pytest.mark.parametrize("args, param, status", [
    ({"temperature": -1}, "temperature", 400),
    ({"n": 0}, "n", 400),
    ({"top_p": 1.5}, "top_p", 400),
    ({"messages": []}, "messages", 400),
    ({"messages": [{"content": "no role"}]}, "messages.0.role", 400),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    ({"presence_penalty": 0.5}, "presence_penalty", 400),
    ({"model": "gpt-4"}, "model", 404),
])
def test_bad_parameters_are_refused_with_the_field_named(fleet, args, param, status):
    http, _ = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **args}
    with pytest.raises(openai.APIStatusError) as e:
        http.chat.completions.create(**body)
    assert e.value.status_code == status and e.value.param == param, e.value.body
    assert http.completions.create(model=MODEL, prompt="still up", max_tokens=2).choices[0].text is not None


def test_a_caller_that_goes_away_ends_its_request_on_the_replicas(fleet):
    http, grpc_client = fleet
    with pytest.raises(openai.APITimeoutError):  # 1000 tokens take seconds; the caller gives up after one
        http.with_options(timeout=1.0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=1000, n=8,
            extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 1.5  # ended, not left to run to its end
    while grpc_client.status().gateway_in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    status = grpc_client.status()
    assert status.gateway_in_flight == 0 and all(m.in_flight == 0 for m in status.members), status
