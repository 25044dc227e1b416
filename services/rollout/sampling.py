"""Token sampling for the hf engine: temperature, top-k, top-p, per-completion seeded generators."""

from __future__ import annotations

import torch

from rlsync.rollout.types import SamplingParams


def make_generator(device: torch.device, seed: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token id from a row of raw logits (float32, [vocab])."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        scaled = scaled.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
