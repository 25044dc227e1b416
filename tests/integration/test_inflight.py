"""In-flight updates (sync mode `inflight`): a real trainer pushes a new version into a real replica
(hf, and vLLM's CPU build) while a stream runs on it. The stream never stops and is never aborted:
its tokens before the switch carry N, the ones after it N+1, and (hf, greedy) its text is exactly
what one run with the switch at that token gives, with or without recomputing the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import engines, rollout_args
from rlsync.client import RolloutClient, TrainerClient, commit_staged, push_weights, stage_weights, trajectory
from streams import Stream, wait_in_flight

ENGINE_EXTRA = {"vllm": {"dtype": "float32"}, "sglang": {"dtype": "float32"}, "hf": {}}
TOKENS = 900  # long enough that the push lands while the stream runs


@pytest.fixture(scope="module", params=engines("hf", "vllm", "sglang"))
def pair(request, module_services):
    engine = request.param
    trainer = module_services.start("trainer", ["--lr", "0.05"], name=f"trainer-inflight-{engine}")
    rollout = module_services.start("rollout", rollout_args(engine, **ENGINE_EXTRA[engine]),
                                    name=f"rollout-inflight-{engine}")
    t, r = TrainerClient(trainer.address), RolloutClient(rollout.address)
    r.engine = engine
    yield t, r


def _train(trainer: TrainerClient, rollout: RolloutClient, seed: int) -> None:
    done = rollout.complete("3+4=", max_tokens=8, logprobs=True, ignore_eos=True, n=4, seed=seed)
    trainer.train([trajectory(c, reward=float(i), group_id="g") for i, c in enumerate(done)])


def _update_under(trainer: TrainerClient, rollout: RolloutClient, prompt, recompute_kv: bool, seed: int,
                  served: Path | None = None, **kw) -> tuple[Stream, int]:
    """Trains a step, stages its weights, opens a stream and commits once the replica runs it (its
    own count: chunks can reach a busy client late) and a token of it has come; returns the stream
    once it ends, and the version it started on (with `served`: its weights saved there). On a busy
    machine a stream can still finish before the commit lands (its final record then holds one
    version), and then it is all done again."""
    for attempt in range(5):
        if served is not None:  # the trainer's weights are the replica's until the step below
            trainer.save_checkpoint(str(served))
        _train(trainer, rollout, seed + 100 * attempt)
        old = rollout.info().weight_version
        push = stage_weights(trainer, [rollout])
        stream = Stream(rollout, prompt, max_tokens=TOKENS, ignore_eos=True, **kw)
        wait_in_flight(rollout, 1, streams=[stream])
        stream.first.wait(30)  # in flight may still mean queued (SGLang): the switch must follow a token
        commit_staged([rollout], push, recompute_kv=recompute_kv)  # lands while the stream runs, or just after
        stream.thread.join(120)
        assert not stream.thread.is_alive() and not stream.error, stream.error
        if len(stream.chunks[-1].version_spans) > 1:
            return stream, old
    raise AssertionError("every stream finished before its update was committed")


@pytest.mark.parametrize("recompute_kv", [False, True], ids=["kv-kept", "kv-recomputed"])
def test_stream_spanning_an_update_goes_on_and_carries_both_versions(pair, recompute_kv):
    trainer, rollout = pair
    stream, old = _update_under(trainer, rollout, "a long story", recompute_kv, seed=int(recompute_kv))
    new = rollout.info().weight_version
    assert new > old and not stream.error
    final = stream.chunks[-1]
    assert final.finish_reason == 2, f"ended {final.finish_reason} ({final.finish_detail}): never aborted"
    assert stream.tokens == TOKENS
    spans = [(s.weight_version, s.start, s.length) for s in final.version_spans]
    assert [v for v, _, _ in spans] == [old, new], f"the switch must fall inside the stream: {spans}"
    assert spans[0][1] == 0 and spans[1][1] == spans[0][2] and spans[0][2] + spans[1][2] == TOKENS
    versions = stream.versions()
    assert versions == sorted(versions) and versions[0] == old and versions[-1] == new


def _greedy(model, cache: DynamicCache, fed: list[int], count: int) -> list[int]:
    """Feeds `fed` on top of `cache`, then decodes `count` tokens greedily."""
    out = []
    ids = fed
    with torch.inference_mode():
        for _ in range(count):
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = out[-1:]
    return out


# the reference: transformers, decoding as the engines do
@pytest.mark.parametrize("pair", ["hf", "vllm"], indirect=True)
@pytest.mark.parametrize("recompute_kv", [False, True], ids=["kv-kept", "kv-recomputed"])
def test_greedy_text_equals_one_run_switched_at_that_token(pair, recompute_kv, tmp_path):
    trainer, rollout = pair
    push_weights(trainer, [rollout])  # the replica serves the trainer's weights
    before = tmp_path / "before"
    prompt = rollout.complete("the model reads", max_tokens=1)[0].prompt_token_ids
    stream, _ = _update_under(trainer, rollout, list(prompt), recompute_kv, seed=7 + int(recompute_kv),
                              served=before, temperature=0)
    after = tmp_path / "after"
    trainer.save_checkpoint(str(after))
    got = [t for c in stream.chunks for t in c.token_ids]
    spans = stream.chunks[-1].version_spans
    assert len(spans) == 2, f"the switch must fall inside the stream: {spans}"
    k = spans[0].length  # tokens sampled from the old weights' logits
    old, new = (AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in (before, after))
    cache = DynamicCache()
    head = _greedy(old, cache, list(prompt), k)  # the cache now holds prompt + head[:-1]
    if recompute_kv:  # the new weights rebuild the cache from the tokens so far
        tail = _greedy(new, DynamicCache(), list(prompt) + head, TOKENS - k)
    else:  # the new weights decode on the cache the old ones built
        tail = _greedy(new, cache, head[-1:], TOKENS - k)
    assert got[:k] == head
    assert got[k:] == tail
    unchanged = _greedy(old, DynamicCache(), list(prompt) + head, TOKENS - k)
    assert tail != unchanged, "the new weights must change the text (or this test proves nothing)"
