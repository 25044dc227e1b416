"""Batched decoding for the hf engine: running sequences share one left-padded KV cache.

The cache is rebuilt only when the batch changes (a sequence joins or leaves); a decode step is
one forward of [batch, 1] tokens. Pure torch + transformers; the engine thread drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from rlsync.rollout.detokenize import IncrementalText
from rlsync.rollout.types import SamplingParams

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [batch, heads, time, dim]
# Every attention backend but cuDNN's: it builds a new plan for each new sequence length, which is
# every decode step here, at ~1.8 ms of CPU per layer (H100, measured: a decode step of 32 sequences
# on a 28-layer 1.7B model took 150 ms with it, 40 ms without).
ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(eq=False)
class Sequence:
    """One completion: a request with n > 1 has n of these."""

    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    text: IncrementalText
    sink: object  # where the engine delivers this sequence's Deltas
    output: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, not yet fed through the model

    @property
    def length(self) -> int:
        """Tokens already in the KV cache."""
        return len(self.prompt) + len(self.output) - (1 if self.next_token is not None else 0)


def _layers(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(kv: KV, mask: torch.Tensor, width: int) -> tuple[KV, torch.Tensor]:
    """Adds `width` padding columns on the left of a cache and its mask."""
    if width == 0:
        return kv, mask
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, width, 0))  # noqa: E731 - time is dim -2
    return [(pad(k), pad(v)) for k, v in kv], torch.nn.functional.pad(mask, (width, 0))


class Batch:
    """Running sequences, their shared cache and attention mask (1 = real token, 0 = padding)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.seqs: list[Sequence] = []
        self.kv: KV = []
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)

    def __len__(self) -> int:
        return len(self.seqs)

    def kv_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[list[KV], torch.Tensor]:
        """Runs prompts in one forward (several: left-padded and masked); returns each prompt's own
        cache (batch size 1, no padding) and the logits of each one's last position [n, vocab]."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        masked = {}
        if len(prompts) > 1:
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            masked = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        with sdpa_kernel(ATTENTION):
            out = self.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, **masked)
        layers = _layers(out.past_key_values)
        kvs = [[(k[i:i + 1, :, width - len(p):], v[i:i + 1, :, width - len(p):]) for k, v in layers]
               for i, p in enumerate(prompts)]
        return kvs, out.logits[:, -1].float()

    def add(self, seqs: list[Sequence], kv: KV) -> None:
        """Joins sequences that share one prefilled prompt cache (`kv` has batch size 1)."""
        length = kv[0][0].shape[-2]
        kv = [(k.expand(len(seqs), -1, -1, -1), v.expand(len(seqs), -1, -1, -1)) for k, v in kv]
        mask = torch.ones(len(seqs), length, dtype=torch.long, device=self.device)
        if not self.seqs:
            self.seqs, self.kv, self.mask = list(seqs), [(k.contiguous(), v.contiguous()) for k, v in kv], mask
            return
        width = self.mask.shape[1]
        kv, mask = _pad_left(kv, mask, max(0, width - length))
        self.kv, self.mask = _pad_left(self.kv, self.mask, max(0, length - width))
        self.kv = [(torch.cat([k0, k1]), torch.cat([v0, v1])) for (k0, v0), (k1, v1) in zip(self.kv, kv)]
        self.mask = torch.cat([self.mask, mask])
        self.seqs += seqs

    def remove(self, done: set[Sequence]) -> None:
        """Drops finished sequences and the padding columns no sequence needs any more."""
        if not done:
            return
        keep = [i for i, s in enumerate(self.seqs) if s not in done]
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.kv, self.mask = [], self.mask[:0, :0]
            return
        index = torch.tensor(keep, device=self.device)
        self.mask = self.mask.index_select(0, index)
        first = int(self.mask.any(dim=0).nonzero()[0])
        self.mask = self.mask[:, first:]
        self.kv = [(k.index_select(0, index)[:, :, first:], v.index_select(0, index)[:, :, first:])
                   for k, v in self.kv]

    def recompute(self) -> int:
        """Rebuilds every running sequence's cache with the model's current weights (after a swap):
        their tokens so far are prefilled again, in one forward. Returns how many sequences."""
        seqs = self.seqs
        self.seqs, self.kv, self.mask = [], [], self.mask[:0, :0]
        if seqs:
            kvs, _ = self.prefill([(s.prompt + s.output)[:s.length] for s in seqs])
            for s, kv in zip(seqs, kvs):
                self.add([s], kv)
        return len(seqs)

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feeds every sequence's pending token; returns next-token logits [batch, vocab] (float32)."""
        tokens = torch.tensor([[s.next_token] for s in self.seqs], device=self.device)
        positions = torch.tensor([[s.length] for s in self.seqs], device=self.device)
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)
        with sdpa_kernel(ATTENTION):
            out = self.model(input_ids=tokens, position_ids=positions, attention_mask=self.mask,
                             past_key_values=DynamicCache(ddp_cache_data=self.kv), use_cache=True)
        self.kv = _layers(out.past_key_values)
        return out.logits[:, -1].float()
