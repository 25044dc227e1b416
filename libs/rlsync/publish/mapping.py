"""How a trainer's parameters become the tensors an engine loads: names, dtypes, filters, fused and
tied weights. Pure: it works on names, shapes and dtypes only, so a mismatch is refused before any
byte moves, naming the offending tensors."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from rlsync.checkpoint_names import Stacked, Unfuse, View, unfused
from rlsync.errors import InvalidArgument

# Name components that wrappers add and engines never expect (whole components, never substrings):
# torch.compile, activation checkpointing and FSDP1 anywhere in a name; DDP's "module" in front.
WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
LEADING_WRAPPERS = WRAPPERS | {"module"}


@dataclass(frozen=True)
class Entry:
    """One tensor the engine receives: made from `parts` (trainer names; several are concatenated
    along dim 0), cast to `dtype`; or, with `view`, one expert's tensor of a fused experts parameter
    (rlsync.checkpoint_names.View: a contiguous view of it, under the checkpoint's name), or the whole
    parameter stacked (Stacked: [E, n, R, ...], under its own name)."""

    name: str
    parts: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: View | Stacked | None = None


@dataclass
class WeightMap:
    """Trainer names -> engine names and dtypes. Every field is optional; the default publishes every
    parameter under its own name (wrapper prefixes stripped), in the dtype it trains in."""

    #: A dict {trainer name: engine name}, or a callable returning the engine name; None drops the tensor.
    rename: Mapping[str, str | None] | Callable[[str], str | None] | None = None
    #: Glob patterns on engine names: only matching tensors are published (empty: all).
    include: Sequence[str] = ()
    #: Glob patterns on engine names that are never published (a value head, say).
    exclude: Sequence[str] = ()
    #: Floating-point tensors are cast to this on the way out (fp32 master weights to a bf16 engine).
    dtype: torch.dtype | None = None
    #: {engine name: [engine names]}: tensors concatenated along dim 0 into one (q, k, v -> qkv).
    fuse: Mapping[str, Sequence[str]] = field(default_factory=dict)
    #: {engine name: engine name}: a tensor published again under a second name (an untied lm_head
    #: the engine expects, whose values are the embedding's).
    tied: Mapping[str, str] = field(default_factory=dict)

    def engine_name(self, name: str) -> str | None:
        parts = name.split(".")
        while len(parts) > 1 and parts[0] in LEADING_WRAPPERS:
            parts.pop(0)
        name = ".".join([p for p in parts[:-1] if p not in WRAPPERS] + parts[-1:])
        if self.rename is None:
            return name
        if callable(self.rename):
            return self.rename(name)
        return self.rename.get(name, name)

    def _wanted(self, name: str) -> bool:
        if self.include and not any(fnmatchcase(name, p) for p in self.include):
            return False
        return not any(fnmatchcase(name, p) for p in self.exclude)

    def _cast(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def plan(self, tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
             experts: Sequence[Unfuse] = (), stacked: Collection[str] = ()) -> list[Entry]:
        """(trainer name, global shape, dtype) of each parameter -> the engine's tensors, in order.
        `experts`: the model's fused experts parameters, published per expert under the checkpoint's
        names (engines load those), applied after renaming; or, those named in `stacked` (trainer names),
        whole and stacked, for replicas that take them so (WeightFormat.stacked_experts)."""
        named: dict[str, Entry] = {}
        for source, shape, dtype in tensors:
            name = self.engine_name(source)
            if name is None:
                continue
            per_expert = unfused(name, tuple(shape), experts)
            if per_expert is not None and source in stacked:
                view = Stacked(per_expert[-1][1].chunks)
                per_expert = [(name, view, view.shape(shape))]
            for n, view, s in per_expert or [(name, None, tuple(shape))]:
                if n in named:
                    raise InvalidArgument(f"{source!r} and {named[n].parts[0]!r} both map to {n!r}: "
                                          "rename one of them")
                named[n] = Entry(n, (source,), s, self._cast(dtype), view)
        for name, members in self.fuse.items():
            missing = [m for m in members if m not in named]
            if missing:
                raise InvalidArgument(f"fuse {name!r}: no tensor named {missing} (engine names: after renaming)")
            parts = [named.pop(m) for m in members]
            if any(p.view is not None for p in parts):
                raise InvalidArgument(f"fuse {name!r}: {[p.name for p in parts if p.view is not None]} are views of "
                                      "a fused experts parameter already (the engine loads them per expert)")
            if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
                raise InvalidArgument(f"fuse {name!r}: {[(p.name, list(p.shape), str(p.dtype)) for p in parts]} "
                                      "differ beyond dim 0 or in dtype, so they cannot be concatenated")
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            named[name] = Entry(name, tuple(s for p in parts for s in p.parts), shape, parts[0].dtype)
        for alias, target in self.tied.items():
            if target not in named:
                raise InvalidArgument(f"tied {alias!r} -> {target!r}: there is no tensor {target!r} to tie to")
            if alias in named:
                raise InvalidArgument(f"tied {alias!r}: the model already has a tensor of that name")
            named[alias] = Entry(alias, named[target].parts, named[target].shape, named[target].dtype,
                                 named[target].view)
        out = [e for e in named.values() if self._wanted(e.name)]
        if not out:
            raise InvalidArgument("nothing to publish: every parameter was renamed away or filtered out "
                                  f"(include={list(self.include)}, exclude={list(self.exclude)})")
        return out
