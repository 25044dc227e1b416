"""The trainer-vs-engine logprob gap and the truncated importance sampling weights (rlsync.trainer.mismatch),
and the GRPO loss they reweight."""

from __future__ import annotations

import math

import pytest
import torch

from rlsync.trainer.grpo import grpo_loss, make_batch
from rlsync.trainer.mismatch import logprob_gap, tis_weights


def test_gap_is_the_mean_absolute_difference_over_the_sampled_tokens_only():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    engine = torch.tensor([[-1.5, -1.0, 7.0], [-0.1, -3.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column: padding, far off, left out
    total, count = logprob_gap(trainer, engine, mask)
    assert count == 4 and total / count == pytest.approx((0.5 + 1.0 + 0.0 + 0.25) / 4)


def test_gap_adds_up_over_micro_batches_to_the_mean_of_the_step():
    trainer, engine = torch.randn(6, 5), torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    parts = [logprob_gap(trainer[i:i + 2], engine[i:i + 2], mask[i:i + 2]) for i in (0, 2, 4)]
    whole = logprob_gap(trainer, engine, mask)
    assert sum(p[0] for p in parts) == pytest.approx(whole[0]) and sum(p[1] for p in parts) == whole[1]


def test_gap_is_zero_when_the_engine_computes_what_the_trainer_does():
    lp = torch.randn(3, 4)
    assert logprob_gap(lp, lp.clone(), torch.ones(3, 4)) == (0.0, 12.0)


def test_tis_weight_is_the_probability_ratio_truncated_at_the_cap():
    trainer = torch.tensor([-1.0, -1.0, -1.0, -5.0])
    engine = torch.tensor([-1.0, -1.2, -3.0, -1.0])
    w = tis_weights(trainer, engine, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, math.exp(0.2), 2.0, math.exp(-4.0)])  # exp(2) = 7.4 is truncated


def test_tis_weight_carries_no_gradient():
    trainer = torch.tensor([-1.0, -2.0], requires_grad=True)
    w = tis_weights(trainer, torch.tensor([-1.5, -1.0]), cap=2.0)
    assert not w.requires_grad


def test_tis_cap_must_be_positive():
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(torch.zeros(2), torch.zeros(2), cap=0.0)


def test_token_weights_scale_each_tokens_policy_gradient():
    batch = make_batch([[1, 2]], [[3, 4, 5]], [[-1.0, -1.0, -1.0]], [1.0], [1.0], pad_id=0, device=torch.device("cpu"))
    logprobs = batch.behavior.clone().requires_grad_(True)  # on-policy: the ratio is 1 on every token
    plain, _ = grpo_loss(logprobs, batch, clip_eps=0.2, total_tokens=3)
    plain.backward()
    g_plain = logprobs.grad.clone()
    logprobs.grad = None
    weights = torch.tensor([[1.0, 0.5, 2.0, 1.0]])  # position 0 predicts a prompt token: masked out anyway
    weighted, _ = grpo_loss(logprobs, batch, clip_eps=0.2, total_tokens=3, token_weights=weights)
    weighted.backward()
    assert torch.allclose(logprobs.grad, g_plain * weights)
    assert weighted.item() == pytest.approx(plain.item() * (0.5 + 2.0 + 1.0) / 3)
