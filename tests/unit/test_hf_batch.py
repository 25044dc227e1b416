"""The hf engine's row cache: whatever joins, leaves and forks between steps, each row's logits are
the model's own for that sequence's tokens, and a step is one forward whoever joins."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from rlsync.rollout.engines.hf_attention import Pass, attend
from rlsync.rollout.engines.hf_batch import Batch, Sequence
from rlsync.rollout.types import SamplingParams


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def models(request, tiny_model):
    """(the batch's model, a reference with transformers' own attention), on the device"""
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).to(request.param).eval()  # noqa: E731
    return load(), load()


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(), None, None, None)


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits[0, -1].float()


def _feed(seq: Sequence, token: int) -> None:
    seq.output.append(token)
    seq.next_token = token


steps = st.lists(st.tuples(st.lists(st.booleans(), max_size=24),  # which running sequences finish
                           st.lists(st.tuples(st.integers(1, 12), st.integers(1, 3)), max_size=3),  # prompts: length, n
                           st.booleans()),  # rebuild the cache (a swap with recompute)
                 min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(script=steps, seed=st.integers(0, 1 << 16))
def test_every_row_decodes_as_the_model_does_alone(models, script, seed):
    model, reference = models
    rng = random.Random(seed)
    batch = Batch(model, model.device)
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        for finish, joins, rebuild in script:
            batch.remove({s for s, f in zip(batch.seqs, finish) if f})
            if rebuild:
                assert batch.recompute() == len(batch.seqs)
            prompts = [[rng.randrange(1, 500) for _ in range(length)] for length, _ in joins]
            if not batch.seqs and not prompts:
                continue  # (the engine steps only with work)
            before, calls[:] = list(batch.seqs), []
            running, first = batch.step(prompts)
            assert len(calls) == 1, "one forward per step, whoever joins"
            assert running.shape[0] == len(before) and first.shape[0] == len(prompts)
            for seq, row in zip(before, running):
                torch.testing.assert_close(row, _reference(reference, seq.prompt + seq.output), atol=1e-3, rtol=1e-4)
                _feed(seq, int(row.argmax()))
            for i, ((_, n), prompt, row) in enumerate(zip(joins, prompts, first)):
                torch.testing.assert_close(row, _reference(reference, prompt), atol=1e-3, rtol=1e-4)
                seqs = [_seq(prompt) for _ in range(n)]
                for seq in seqs:  # each completion's own first token: the forked rows must diverge
                    _feed(seq, rng.randrange(1, 500))
                batch.join(i, seqs)
    finally:
        hook.remove()


def test_an_emptied_batch_gives_its_cache_back(models):
    model, _ = models
    batch = Batch(model, model.device)
    batch.step([[1, 2, 3]])  # a prompt whose completions all end at their first token: nobody joins
    batch.remove(set())
    assert batch.kv_bytes() == 0
    batch.step([[1, 2, 3], [4, 5]])
    seqs = [_seq([1, 2, 3]), _seq([4, 5])]
    for i, seq in enumerate(seqs):
        _feed(seq, 7)
        batch.join(i, [seq])
    batch.step([])
    assert batch.kv_bytes() > 0
    batch.remove(set(seqs))
    assert batch.kv_bytes() == 0


def test_a_batch_gives_back_the_rows_a_burst_took_and_its_rows_keep_their_caches(models):
    """Rows shrink (by the rule columns follow) once a quarter of them would do: the survivors, moved
    from the tail into the leavers' rows first, decode as the model does alone."""
    model, reference = models
    batch = Batch(model, model.device)
    prompts = [[i + 1, i + 2, i + 3 + i % 4] for i in range(20)]
    batch.step(prompts)
    seqs = [_seq(p) for p in prompts]
    for i, seq in enumerate(seqs):
        _feed(seq, 9 + i)
        batch.join(i, [seq])
    running, _ = batch.step([])
    for seq, row in zip(batch.seqs, running):
        _feed(seq, int(row.argmax()))
    grown = batch.cache.shape[0]
    keep = {seqs[1], seqs[18], seqs[19]}  # two from the tail, past the rows the cache keeps
    batch.remove(set(seqs) - keep)
    running, _ = batch.step([])
    assert batch.cache.shape[0] < grown and all(kv[0].shape[0] == batch.cache.shape[0] for kv in batch.cache.layers)
    for seq, row in zip(batch.seqs, running):
        torch.testing.assert_close(row, _reference(reference, seq.prompt + seq.output), atol=1e-3, rtol=1e-4)


def test_a_prompts_forks_count_in_the_cache_before_their_step_grows_it(models):
    """The completions of an n > 1 prompt take their rows at the step after its prefill: the batch
    says so before that step (the engine checks the spare weights' room then), and its bytes count them."""
    model, _ = models
    batch = Batch(model, model.device)
    batch.step([[1, 2, 3]])
    held, one = batch.cache.shape[0], batch.kv_bytes()
    seqs = [_seq([1, 2, 3]) for _ in range(3 * held)]
    for i, seq in enumerate(seqs):
        _feed(seq, 5 + i)
    batch.join(0, seqs)
    assert batch.outgrown() and batch.kv_bytes_next() == one * len(seqs) // held and batch.kv_bytes() == one
    batch.step([])
    assert not batch.outgrown() and batch.cache.shape[0] >= len(seqs)
    assert batch.kv_bytes_next() == batch.kv_bytes() > one


def test_attention_it_lacks_is_refused_by_name(models):
    model, _ = models
    batch = Batch(model, model.device)
    q, kv = torch.zeros(1, 4, 2, 8, device=model.device), torch.zeros(1, 2, 2, 8, device=model.device)
    plan = Pass(batch.cache, 0, torch.zeros(2, dtype=torch.long), torch.arange(2), 0, [(0, 0, 2)])
    with pytest.raises(ValueError, match="no softcap.*vllm or sglang"):
        attend(model.model.layers[0].self_attn, q, kv, kv, None, plan=plan, softcap=30.0)
