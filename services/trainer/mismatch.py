"""The trainer-vs-engine mismatch, pure torch: how far the engine's sampling logprobs are from the
trainer's (an FP8 engine serving a bf16 trainer's weights, or another kernel), and the truncated
importance sampling weight that corrects the policy gradient for it (as verl and slime do)."""

from __future__ import annotations

import torch


def logprob_gap(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(sum, count) of |engine - trainer| over the tokens of `mask` (the sampled tokens whose engine
    logprobs were sent): summed so micro-batches add up to one mean per step."""
    gap = (engine - trainer.detach()).abs() * mask
    return float(gap.sum()), float(mask.sum())


def tis_weights(trainer: torch.Tensor, engine: torch.Tensor, cap: float) -> torch.Tensor:
    """min(p_trainer / p_engine, cap) per token, detached: the tokens were sampled from the engine's
    distribution and the gradient is the trainer's, so each token's loss is reweighted by the ratio of
    the two, truncated at `cap` so that a token the engine oversampled by chance cannot dominate."""
    if cap <= 0:
        raise ValueError(f"the truncation cap must be > 0, not {cap}")
    return torch.exp(trainer.detach() - engine).clamp(max=cap)
