"""Named tensors packed into one contiguous buffer per dtype ("flat storage").

The trainer keeps its parameters this way (a colocated receiver maps them in one piece and copies
once), and the hf engine too (sleep/wake is one copy per dtype; an update lands in a second store
and goes live by re-pointing the parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

Allocator = Callable[[int, torch.dtype], torch.Tensor]  # (numel, dtype) -> 1-D tensor


class Store(Protocol):
    """Staging whose views stay where they are for as long as it lives (a FlatStore, a vLLM worker's BoxStaging):
    what a receiver lays out over them is kept in its `memo` for the next update into it."""

    views: Mapping[str, torch.Tensor]
    memo: dict

    def views_for(self, specs) -> Mapping[str, torch.Tensor]:
        """Its views under the names of a manifest's `specs` (FlatStore.views_for)."""


class FlatStore:
    """Tensors of `specs` packed per dtype. `spans`: other names for runs of them, each the names it stands for in
    order (a fused experts parameter's: the checkpoint's tensors of its experts), which a manifest may use
    (views_for)."""

    def __init__(self, specs: dict[str, tuple[torch.Size, torch.dtype]], device: torch.device | str = "cpu",
                 pin: bool = False, allocate: Allocator | None = None,
                 spans: Mapping[str, tuple[str, ...]] | None = None):
        sizes: dict[torch.dtype, int] = {}
        offsets = {}
        for name, (shape, dtype) in specs.items():
            offsets[name] = sizes.get(dtype, 0)
            sizes[dtype] = offsets[name] + torch.Size(shape).numel()
        if allocate is None:
            def allocate(n: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(n, dtype=dtype, device=device, pin_memory=pin)
        self.buffers = {dtype: allocate(n, dtype) for dtype, n in sizes.items()}
        self._offsets = offsets
        self._numel = sum(sizes.values())
        self.spans = spans or {}
        self.views = {name: self.buffers[dtype][offsets[name]:offsets[name] + torch.Size(shape).numel()].view(shape)
                      for name, (shape, dtype) in specs.items()}
        # (name, dtype, shape) in buffer order: a receiver whose manifest lists exactly this lands the
        # whole update in the one buffer without looking at any tensor (see whole_for)
        self.layout = tuple((name, dtype, tuple(shape)) for name, (shape, dtype) in specs.items())
        self._matched: tuple = ()  # the specs laid_out_as last found to match
        self._named: tuple = ((), None)  # the specs views_for was last asked for, and its answer
        self._bytes: torch.Tensor | None = None  # the one buffer as bytes (whole_for), cut once
        # What receivers lay out over these views (rlsync.transfer.kept: a routed receiver's writer), kept for
        # the next update into them, and gone with the store.
        self.memo: dict = {}

    def laid_out_as(self, specs) -> bool:
        """Whether `specs` (a manifest's) list this store's tensors, in its order, with their dtypes
        and shapes, under its names or names that stand for runs of them (`spans`): its buffers are the
        manifest's bytes back to back. The specs that matched last are kept: a manifest's cached specs, at
        every update, then compare by identity (no per-tensor work)."""
        if specs is not self._matched and tuple(specs) != self._matched:
            if layout(specs) != self.layout and not self._tiled_by(specs):
                return False
            self._matched = tuple(specs)
        return True

    def views_for(self, specs) -> Mapping[str, torch.Tensor]:
        """This store's tensors under the names of `specs` (a manifest's): its views, and for a name in `spans`
        (a stacked experts parameter: rlsync.checkpoint_names) the run of the tensors it stands for, shaped as the
        spec says (of any dtype: a receiver casts on arrival). Its own views where any spec names neither (a
        receiver then says what is missing). Found once per specs (a manifest's cached tuple: by identity)."""
        if specs is self._named[0]:
            return self._named[1]
        out: dict[str, torch.Tensor] | None = {} if any(s.name not in self.views for s in specs) else None
        for s in specs if out is not None else ():
            try:
                out[s.name] = self.views[s.name] if s.name in self.views else self.span(self.spans[s.name], s.shape)
            except (KeyError, ValueError, RuntimeError):  # (no such run, or not of the spec's elements)
                out = None
                break
        named = out if out is not None else self.views
        self._named = (specs, named)
        return named

    def holds(self, specs) -> bool:
        """Whether `specs` name all of this store's tensors and nothing else, each with its shape and dtype, under
        its names or spans' (views_for): what a delta is taken against, in any order."""
        views = self.views_for(specs)
        return len(views) == len(specs) and sum(math.prod(s.shape) for s in specs) == self._numel and all(
            s.name in views and tuple(views[s.name].shape) == tuple(s.shape) and views[s.name].dtype == s.dtype
            for s in specs)

    def _tiled_by(self, specs) -> bool:
        """holds(specs), and they lie back to back in its buffers in their order."""
        if not self.holds(specs):
            return False
        views, ends = self.views_for(specs), {dtype: buf.data_ptr() for dtype, buf in self.buffers.items()}
        for s in specs:
            view = views[s.name]
            if view.data_ptr() != ends[view.dtype]:
                return False
            ends[view.dtype] += view.numel() * view.element_size()
        return True

    def whole_for(self, specs) -> torch.Tensor | None:
        """The one buffer as bytes, when `specs` (a manifest's) list this store's tensors in its
        order, all of one dtype; else None."""
        if len(self.buffers) != 1 or not self.laid_out_as(specs):
            return None
        if self._bytes is None:
            self._bytes = next(iter(self.buffers.values())).view(torch.uint8)
        return self._bytes

    def span(self, names, shape) -> torch.Tensor:
        """One tensor of `shape` over `names`, consecutive tensors of one dtype in this store (a fused
        parameter over its parts); one name: its view."""
        if len(names) == 1:
            return self.views[names[0]].view(shape)
        dtype = self.views[names[0]].dtype
        start = end = self._offsets[names[0]]
        for n in names:
            if self._offsets[n] != end or self.views[n].dtype != dtype:
                raise ValueError(f"{n!r} does not follow {names[0]!r}..{names[-1]!r} in the store")
            end += self.views[n].numel()
        return self.buffers[dtype][start:end].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def copy_from(self, other: FlatStore) -> None:
        for dtype, buf in self.buffers.items():
            buf.copy_(other.buffers[dtype], non_blocking=True)


def layout(specs) -> tuple:
    """(name, dtype, shape) of each spec (anything with those fields), in order: what two tensor lists
    must share for one's flat buffers and checks to serve the other."""
    return tuple((s.name, s.dtype, tuple(s.shape)) for s in specs)


def specs_of(params: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {n: (p.shape, p.dtype) for n, p in params.items()}


def flat_like(specs, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Empty tensors for manifest specs (name, dtype, shape), packed into one buffer per dtype:
    how an engine keeps weights, and what lets a one-copy transfer land in a single copy."""
    store = FlatStore({s.name: (torch.Size(s.shape), s.dtype) for s in specs}, device)
    return store.views
