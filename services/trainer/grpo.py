"""GRPO-style policy-gradient loss, pure torch: group-normalized advantages, a clipped ratio against
the behaviour policy's logprobs, an optional KL penalty to a reference policy."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    """(r - mean of its group) / (std of its group + eps); a group of one gets 0."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        if len(idx) < 2:
            continue
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        norm = (r - r.mean()) / (r.std(unbiased=False) + eps)
        for i, a in zip(idx, norm.tolist()):
            out[i] = a
    return out


@dataclass
class Batch:
    """Right-padded prompt+completion sequences and, per position, what the loss needs."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    target_mask: torch.Tensor  # [B, T-1]: 1 where the next token is a completion token
    targets: torch.Tensor  # [B, T-1]: the next token
    behavior: torch.Tensor  # [B, T-1]: behaviour logprob of that token (0 elsewhere)
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B]: 1, or the stale weight


def make_batch(prompts: list[list[int]], completions: list[list[int]], behavior: list[list[float]],
               advantages: list[float], weights: list[float], pad_id: int, device: torch.device) -> Batch:
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    b = len(prompts)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    attn = torch.zeros((b, length), dtype=torch.long)
    tmask = torch.zeros((b, length - 1))
    beh = torch.zeros((b, length - 1))
    for i, (p, c, lp) in enumerate(zip(prompts, completions, behavior)):
        seq = p + c
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        # position t predicts token t+1: completion tokens are predicted from len(p)-1 onwards
        tmask[i, len(p) - 1:len(seq) - 1] = 1
        if lp:  # none given: filled with the current policy's logprobs by the caller (on-policy)
            beh[i, len(p) - 1:len(seq) - 1] = torch.tensor(lp, dtype=torch.float32)
    return Batch(ids.to(device), attn.to(device), tmask.to(device), ids[:, 1:].to(device), beh.to(device),
                 torch.tensor(advantages, dtype=torch.float32, device=device),
                 torch.tensor(weights, dtype=torch.float32, device=device))


def token_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """log p(next token) at every position, [B, T-1], in float32."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logprobs: torch.Tensor, batch: Batch, clip_eps: float, total_tokens: int,
              ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
              token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Sum over this batch's completion tokens of the clipped surrogate (+ KL), divided by the
    tokens of the whole step (so micro-batches accumulate to a token mean). token_weights [B, T-1]
    (detached) scale each token's surrogate: truncated importance sampling (rlsync.trainer.mismatch)."""
    mask = batch.target_mask
    ratio = torch.exp(logprobs - batch.behavior) * mask + (1 - mask)
    adv = batch.advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate if token_weights is None else -surrogate * token_weights
    kl = torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None and kl_coef > 0:
        delta = ref_logprobs - logprobs
        kl_tok = torch.exp(delta) - delta - 1  # k3 estimator, >= 0
        per_token = per_token + kl_coef * kl_tok
        kl = (kl_tok * mask).sum()
    weighted = per_token * mask * batch.weights[:, None]
    loss = weighted.sum() / total_tokens
    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        clipped = ((ratio - 1).abs() > clip_eps).float() * mask
        stats = {"ratio_mean": float((ratio * mask).sum() / n), "clip_frac": float(clipped.sum() / n),
                 "kl_sum": float(kl), "tokens": float(mask.sum())}
    return loss, stats
