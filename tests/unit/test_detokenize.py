"""Incremental detokenization: no broken characters mid-stream, stop strings held back and cut."""

import pytest
from transformers import AutoTokenizer

from rlsync.rollout.detokenize import IncrementalText


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def _stream(tokenizer, text, stop=()):
    inc = IncrementalText(tokenizer, stop)
    pieces = [inc.add(t) for t in tokenizer(text)["input_ids"]]
    return pieces, inc


def test_deltas_join_to_the_full_text_and_never_split_a_character(tokenizer):
    text = "the model reads é and 字 then 3+4=7"
    pieces, inc = _stream(tokenizer, text)
    pieces.append(inc.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_cuts_text_and_is_not_emitted(tokenizer):
    pieces, inc = _stream(tokenizer, "alpha beta gamma delta", stop=("gamma",))
    assert inc.stopped_by == "gamma"
    assert "".join(pieces) == "alpha beta "


def test_text_that_may_become_a_stop_string_is_held_back(tokenizer):
    inc = IncrementalText(tokenizer, ("beta gamma",))
    out = "".join(inc.add(t) for t in tokenizer("alpha beta")["input_ids"])
    assert not out.endswith("beta"), "a possible stop-string prefix must wait"
    assert out + inc.flush() == "alpha beta"
