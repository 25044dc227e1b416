"""Validation of sampling parameters: every bad value is refused with a message saying what to change."""

import pytest

from rlsync.errors import InvalidArgument
from rlsync.rollout.types import SamplingParams


@pytest.mark.parametrize("params, fragment", [
    (dict(n=0), "n must be >= 1"),
    (dict(n=2000), "n must be <= 1024"),
    (dict(n=2, temperature=0), "n must be 1 with temperature 0"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(stop=("",)), "stop strings"),
    (dict(max_tokens=100), "lower max_tokens to at most 90"),
])
def test_refused_with_actionable_message(params, fragment):
    with pytest.raises(InvalidArgument, match=fragment.replace("(", r"\(")):
        SamplingParams(**params).check(prompt_len=10, max_model_len=100)


def test_prompt_filling_the_context_says_to_shorten_it():
    with pytest.raises(InvalidArgument, match="shorten the prompt"):
        SamplingParams(max_tokens=1).check(prompt_len=100, max_model_len=100)


@pytest.mark.parametrize("params", [dict(), dict(temperature=0), dict(top_k=-1), dict(top_k=0), dict(top_p=1.0),
                                    dict(n=4, temperature=0.7, top_k=5, top_p=0.9, stop=("x",), max_tokens=90)])
def test_valid_values_pass(params):
    SamplingParams(**params).check(prompt_len=10, max_model_len=100)
