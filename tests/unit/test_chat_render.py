"""A chat prompt is rendered by the model's own chat template, or refused when it has none."""

import copy

import pytest
from transformers import AutoTokenizer

from rlsync.errors import InvalidArgument
from rlsync.rollout.core import render_chat


def test_a_conversation_becomes_the_templates_tokens_ending_with_the_generation_prompt(tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = render_chat(tok, [("system", "add"), ("user", "3+4=")])
    assert tok.decode(ids) == "system: add\nuser: 3+4=\nassistant:"


def test_a_tokenizer_without_a_template_is_refused_with_what_to_do(tiny_model):
    tok = copy.deepcopy(AutoTokenizer.from_pretrained(str(tiny_model)))
    tok.chat_template = None
    with pytest.raises(InvalidArgument, match="no chat template.*/v1/completions"):
        render_chat(tok, [("user", "hi")])
