"""The hf engine's attention over its row cache: every layer's keys and values written in place,
one row per running sequence, so that one forward of packed tokens serves both the sequences
decoding (a token each) and the prompts joining (whole), and a step copies no more of the cache
than the rows that changed hands (or all of it, when it grows).

Registered as a transformers attention function (`AttentionInterface`): the model's own layers
compute projections, norms and rotary embeddings; this computes attention for the packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AttentionInterface

NAME = "rlsync_rows"
UNSUPPORTED = ("softcap", "s_aux")  # what some models' attention adds (logit soft-capping, sinks)


@dataclass(eq=False)
class Pass:
    """One forward's plan, shared by every layer. Packed tokens: first `decode` tokens, one per row
    0..decode-1; then each prefill (row, first token, count) with positions 0..count-1."""

    cache: RowCache
    decode: int
    rows: torch.Tensor  # [T] the row each token's keys and values go to
    cols: torch.Tensor  # [T] ... and the column (its position)
    width: int  # columns the decoding rows attend over (their longest, rounded up)
    prefill: list[tuple[int, int, int]]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # decode masks by sliding window

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """[decode, 1, 1, width]: a row's own columns (the last `window` of them, if any)."""
        if window not in self.masks:
            col = torch.arange(self.width, device=self.rows.device)
            lengths = self.cols[:self.decode, None] + 1  # each decoding row's, with this token
            mask = col < lengths
            if window:
                mask &= col >= lengths - window
            self.masks[window] = mask[:, None, None, :]
        return self.masks[window]


class RowCache:
    """Per layer, keys and values [rows, kv_heads, columns, head_dim]; row r is the r-th running
    sequence's, column c its token at position c. Layers are laid out by the first forward that
    reaches them, and resized (and rows moved) when a forward first reaches them after a plan
    changed the shape or the rows' order, one layer at a time (so a resize holds both copies of
    one layer at most)."""

    def __init__(self):
        self.layers: list[list[torch.Tensor]] = []  # [keys, values] per layer
        self.shape = (0, 0)  # rows, columns every layer is brought to
        self.move: tuple[torch.Tensor, torch.Tensor, int] | None = None  # rows to, from, columns
        self.unmoved: set[int] = set()  # layers the move is still to be done in

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for kv in self.layers for t in kv)

    def clear(self) -> None:
        self.layers, self.shape, self.move, self.unmoved = [], (0, 0), None, set()

    def plan_move(self, to: list[int], source: list[int], columns: int) -> None:
        """Row to[i] becomes what row source[i] holds (all read before any is written), in every
        layer, before the next forward writes it."""
        assert not self.unmoved, "a move is done by a forward before the next is planned"
        if to and self.layers:
            device = self.layers[0][0].device
            self.move = (torch.tensor(to, device=device), torch.tensor(source, device=device), columns)
            self.unmoved = set(range(len(self.layers)))

    def layer(self, index: int, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
        """Layer `index`'s [keys, values] at the planned shape, with its planned moves done."""
        rows, cols = self.shape
        if index == len(self.layers):
            self.layers.append([t.new_zeros(rows, t.shape[1], cols, t.shape[3]) for t in (key, value)])
        kv = self.layers[index]
        shrinks = kv[0].shape[0] > rows  # rows move before the tail is cut off, and after new rows exist
        if shrinks:
            self._move(index, kv)
        if kv[0].shape[0] != rows or kv[0].shape[2] != cols:  # zeros: a masked column times NaN is NaN
            r, c = min(rows, kv[0].shape[0]), min(cols, kv[0].shape[2])
            for j, old in enumerate(kv):
                kv[j] = old.new_zeros(rows, old.shape[1], cols, old.shape[3])
                kv[j][:r, :, :c] = old[:r, :, :c]
        if not shrinks:
            self._move(index, kv)
        return kv

    def _move(self, index: int, kv: list[torch.Tensor]) -> None:
        if index in self.unmoved:
            self.unmoved.discard(index)
            to, source, columns = self.move
            for t in kv:
                t[to, :, :columns] = t[source, :, :columns]


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, scaling: float | None = None, plan: Pass | None = None,
           sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, dim]; key and value [1, kv_heads, T, dim] (packed). Returns [1, T, heads, dim]."""
    if plan is None:
        raise RuntimeError(f"{NAME} attention runs only inside the hf engine's Batch (it needs the row cache)")
    if unsupported := sorted(k for k in UNSUPPORTED if kwargs.get(k) is not None):
        raise ValueError(f"the hf engine's attention has no {', '.join(unsupported)} (this model's attention needs "
                         f"it): serve the model with vllm or sglang")
    keys, values = plan.cache.layer(module.layer_idx, key, value)
    keys[plan.rows, :, plan.cols] = key[0].transpose(0, 1)
    values[plan.rows, :, plan.cols] = value[0].transpose(0, 1)
    q = query[0].transpose(0, 1)  # [T, heads, dim]
    heads, kv_heads = q.shape[1], keys.shape[1]
    outs = []
    if d := plan.decode:
        # one query per row: a KV head's group of query heads attends as that row's "query length",
        # so grouped-query attention needs no repeated keys
        o = sdpa(q[:d].reshape(d, kv_heads, heads // kv_heads, -1), keys[:d, :, :plan.width],
                 values[:d, :, :plan.width], attn_mask=plan.decode_mask(sliding_window), scale=scaling)
        outs.append(o.reshape(d, heads, -1))
    for row, first, count in plan.prefill:
        mask = None
        if sliding_window and count > sliding_window:
            i = torch.arange(count, device=q.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
        o = sdpa(q[first:first + count].transpose(0, 1)[None], keys[row:row + 1, :, :count],
                 values[row:row + 1, :, :count], attn_mask=mask, is_causal=mask is None, scale=scaling,
                 enable_gqa=heads != kv_heads)
        outs.append(o[0].transpose(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[None], None


AttentionInterface.register(NAME, attend)
