"""Batched decoding for the hf engine: running sequences own rows of one cache (hf_attention), and
a step is one forward of packed tokens: a token for each running sequence and the whole prompt of
each joining one. A join costs that forward a few more tokens, not a forward of its own.

Pure torch + transformers; the engine thread drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlsync.rollout.detokenize import IncrementalText
from rlsync.rollout.engines import hf_attention
from rlsync.rollout.engines.hf_attention import Pass, RowCache
from rlsync.rollout.types import SamplingParams

# Every attention backend but cuDNN's: it builds a new plan for each new sequence length (here, every
# WIDTH decode steps), at ~1.8 ms of CPU per layer (H100, measured: a decode step of 32 sequences
# on a 28-layer 1.7B model took 150 ms with it, 40 ms without).
ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
COLUMNS, ROWS = 64, 8  # the cache grows (by half at least) in multiples of these
WIDTH = 16  # decoding rows attend over their longest length rounded up to this (aligned masks)


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


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _resized(need: int, held: int, unit: int) -> int:
    """The cache's rows or columns for a step that needs `need` of the `held`: grown by half at least,
    or given back (to half again as many as needed) once a quarter would do, in multiples of `unit`."""
    if need > held:
        return _round_up(max(need, held * 3 // 2), unit)
    if need * 4 < held:
        return _round_up(need * 3 // 2, unit)
    return held


class Batch:
    """Running sequences; sequence i's cache is row i. Rows that change hands (a sequence left, a
    prompt's completions joined) are moved by the next forward, before it writes."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        model.set_attn_implementation(hf_attention.NAME)
        self.model = model
        self.device = device
        self.seqs: list[Sequence] = []
        self.source: list[int] = []  # the row each sequence's cache is in now (i, unless it moves)
        self.cache = RowCache()
        self.prompts = 0  # prompts the last step prefilled (rows len(seqs)... at that step)
        self.first_prompt_row = 0

    def __len__(self) -> int:
        return len(self.seqs)

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def kv_bytes_next(self) -> int:
        """What the cache holds once the next step seats the completions that joined since the last
        (a prompt's n forks take their rows at the step after its prefill)."""
        rows = self.cache.shape[0]
        return self.cache.nbytes() * max(len(self.seqs), rows) // rows if rows else 0

    def outgrown(self) -> bool:
        """Whether the next step grows the cache's rows for the completions that joined since the last."""
        return len(self.seqs) > self.cache.shape[0]

    def step(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds every running sequence's pending token and prefills each prompt whole, in one
        forward. Returns next-token logits [len(self), vocab] and of each prompt [prompts, vocab]
        (float32); `join` then seats the completions of a prompt that go on running."""
        self.first_prompt_row, self.prompts = len(self.seqs), len(prompts)
        prefill = [(len(self.seqs) + i, p) for i, p in enumerate(prompts)]
        logits = self._forward(self.seqs, prefill)
        return logits[:len(self.seqs)], logits[len(self.seqs):]

    def join(self, prompt: int, seqs: list[Sequence]) -> None:
        """Seats the running completions of the last step's prompt number `prompt`: each takes a
        copy of that prompt's row."""
        assert prompt < self.prompts
        self.seqs += seqs
        self.source += [self.first_prompt_row + prompt] * len(seqs)

    def remove(self, done: set[Sequence]) -> None:
        """Drops finished sequences: the last ones running take their places (each moved row is
        copied at the next forward; a leaver at the tail costs nothing). An empty batch gives its
        cache back at once (a sleep's release, or a step whose joiners all ended at once)."""
        if done:
            end = sum(s not in done for s in self.seqs)
            tail = iter([i for i in range(end, len(self.seqs)) if self.seqs[i] not in done])
            order = [i if self.seqs[i] not in done else next(tail) for i in range(end)]
            self.seqs = [self.seqs[i] for i in order]
            self.source = [self.source[i] for i in order]
        if not self.seqs:
            self.cache.clear()

    def recompute(self) -> int:
        """Rebuilds every running sequence's cache with the model's current weights (after a swap):
        their tokens so far are prefilled again, in one forward. Returns how many sequences."""
        if self.seqs:
            self._forward([], [(i, (s.prompt + s.output)[:s.length]) for i, s in enumerate(self.seqs)])
        return len(self.seqs)

    @torch.inference_mode()
    def _forward(self, decode: list[Sequence], prefill: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward: a token for each of `decode` (rows 0..), then each (row, tokens) prefilled
        from position 0. Returns logits of each decoding row and of each prefill's last token."""
        # 1. plan: rows' moves, the cache's shape, and where each packed token goes
        lengths = [s.length for s in decode]  # (= the column each one's token lands in)
        rows = max([len(decode)] + [row + 1 for row, _ in prefill])
        cols = max([n + 1 for n in lengths] + [len(t) for _, t in prefill])
        moved = [(i, source) for i, source in enumerate(self.source) if source != i]
        self.cache.plan_move([i for i, _ in moved], [s for _, s in moved],
                             max((self.seqs[i].length for i, _ in moved), default=0))
        self.source = list(range(len(self.seqs)))
        held_rows, held_cols = self.cache.shape
        held_rows, held_cols = _resized(rows, held_rows, ROWS), _resized(cols, held_cols, COLUMNS)
        self.cache.shape = (held_rows, held_cols)
        tokens = [s.next_token for s in decode] + [t for _, p in prefill for t in p]
        positions = lengths + [c for _, p in prefill for c in range(len(p))]
        write_rows = list(range(len(decode))) + [row for row, p in prefill for _ in p]
        ends, spans, first = list(range(len(decode))), [], len(decode)
        for row, p in prefill:
            spans.append((row, first, len(p)))
            first += len(p)
            ends.append(first - 1)
        # 2. one copy of the plan to the device, then the forward
        packed = torch.tensor([tokens, positions, write_rows], dtype=torch.long).to(self.device)
        width = min(_round_up(max(lengths, default=0) + 1, WIDTH), held_cols)
        plan = Pass(self.cache, len(decode), packed[2], packed[1], width, spans)
        keep = 0 if not prefill else torch.tensor(ends, device=self.device)  # the logits of a row's last token
        with sdpa_kernel(ATTENTION):
            out = self.model(input_ids=packed[0][None], position_ids=packed[1][None], use_cache=False,
                             logits_to_keep=keep, plan=plan)
        return out.logits[0].float()
