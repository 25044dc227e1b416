"""The toy task: make the policy write digits. Reward = share of the completion's token budget spent
on tokens that are digits (so stopping early or writing words both cost reward); in [0, 1].

A random tiny model puts about a quarter of its probability on digit tokens, so rewards start
near 0.25 and vary within a group: exactly the signal GRPO needs."""

from __future__ import annotations

from functools import cached_property

PROMPTS = ["numbers:", "count to ten", "the sum is", "write digits", "alpha beta", "model reads",
           "reward is high when", "token by token", "the answer is", "yes no true false", "gamma delta",
           "weights move from trainer"]


class DigitsTask:
    def __init__(self, tokenizer, max_tokens: int):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    @cached_property
    def digit_tokens(self) -> frozenset[int]:
        return frozenset(i for i in range(len(self.tokenizer)) if self.tokenizer.decode([i]).strip().isdigit())

    def reward(self, token_ids: list[int]) -> float:
        return sum(t in self.digit_tokens for t in token_ids) / self.max_tokens
