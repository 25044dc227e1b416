"""A model's tensors under its checkpoint's names: fused expert parameters as per-expert views.

transformers 5 keeps a mixture of experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H])
while its checkpoints, and the engines that load them (vLLM, SGLang), name one tensor per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H]). The rules come from transformers' own conversion
mapping (the WeightConverters `from_pretrained` applies and `save_pretrained` reverses), read
here, not restated per architecture. Only the conversions whose reverse is a view are used:
MergeModulelist(dim=0) (expert e is `t[e]`), then optionally Concatenate(dim=1) (source k of n is
the k-th of n equal row blocks of `t[e]`). A per-expert tensor is then a contiguous view of the
fused one: nothing is copied, and a fused parameter is the consecutive run of its experts' tensors.

Replicas that say so (WeightFormat.stacked_experts) take a fused parameter whole instead, *stacked*: [E, n*R, ...]
viewed as [E, n, R, ...] (expert, source, its rows), the same bytes, so that what a tensor-parallel rank loads of
every expert is one box (rank r's rows of each source of each expert) and an expert-parallel rank's experts are one
run: one tensor per layer and projection where there were n*E (`stacked_specs` names its experts' tensors).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from rlsync.transfer.routes import Box, row_major_strides

if TYPE_CHECKING:
    from rlsync.transfer.manifest import Spec


_PLAIN = re.compile(r"^[A-Za-z0-9_.*]+$")  # a dotted name with `*` for the expert index, no other regex


@dataclass(frozen=True)
class Unfuse:
    """A fused parameter named `...<target>` [E, n*R, ...] is, per expert e, the n tensors `...<sources[k]>`
    with `*` = e, each [R, ...] (rows k*R..(k+1)*R of expert e)."""

    target: str
    sources: tuple[str, ...]
    scope: str = ""  # only names under this prefix (a sub-model's conversions)

    def parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, View, tuple[int, ...]]] | None:
        """(checkpoint name, view, shape) of each per-expert tensor of `name`, in memory order; None when
        the rule does not apply to it."""
        if not (name == self.target or name.endswith("." + self.target)) or not name.startswith(self.scope):
            return None
        n = len(self.sources)
        if len(shape) < 2 or shape[1] % n:
            return None
        prefix = name[: len(name) - len(self.target)]
        rows = (shape[1] // n, *shape[2:])
        return [(prefix + src.replace("*", str(e)), View(e, k, n), rows)
                for e in range(shape[0]) for k, src in enumerate(self.sources)]


@dataclass(frozen=True)
class View:
    """Expert `expert`'s `chunk`-th of `chunks` equal row blocks."""

    expert: int
    chunk: int
    chunks: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.expert].chunk(self.chunks, dim=0)[self.chunk]


@dataclass(frozen=True)
class Stacked:
    """A fused experts parameter [E, n*R, ...] as [E, n, R, ...]: expert e's k-th source is `[e, k]`."""

    chunks: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(1, (self.chunks, t.shape[1] // self.chunks))

    def shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[0], self.chunks, shape[1] // self.chunks, *shape[2:])

    def box(self, box: Box | None, shape: Sequence[int]) -> Box | None:
        """A box of the parameter (of `shape`) as a box of the stacked tensor; None for None. Raises ValueError
        where its rows are no box there (they start or end inside a source's rows without staying in one)."""
        if box is None:
            return None
        rows = shape[1] // self.chunks
        (a, b) = box[1]
        if a // rows == (b - 1) // rows:
            k, rows_box = (a // rows, a // rows + 1), (a % rows, (b - 1) % rows + 1)
        elif a % rows == 0 and b % rows == 0:
            k, rows_box = (a // rows, b // rows), (0, rows)
        else:
            raise ValueError(f"rows {a}..{b} of {list(shape)} cut a source's {rows} rows: not a box of it stacked")
        return (box[0], k, rows_box, *box[2:])

    def local(self, t: torch.Tensor, box: Box) -> torch.Tensor:
        """A rank's local values `t` of the parameter as its stacked box `box` (a view)."""
        return t.unflatten(1, (box[1][1] - box[1][0], box[2][1] - box[2][0]))


def expert_rules(model) -> tuple[Unfuse, ...]:
    """The rules transformers' conversion mapping has for `model` whose reverse is a view (see the module
    docstring); none for a model without one (a dense model, or one that is not a transformers model)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    except ImportError:  # a transformers without conversion mappings keeps checkpoint names in memory
        return ()
    if not hasattr(model, "config") or not hasattr(model, "named_modules"):
        return ()
    try:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    except Exception:  # noqa: BLE001 - a model transformers cannot describe: its own names are the checkpoint's
        return ()
    rules = []
    for conv in conversions:
        if not isinstance(conv, WeightConverter):
            continue
        sources = list(getattr(conv, "_original_source_patterns", conv.source_patterns))
        targets = list(getattr(conv, "_original_target_patterns", conv.target_patterns))
        ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
        merged = ops[:1] == [(MergeModulelist, 0)] and (
            (len(ops) == 1 and len(sources) == 1) or ops[1:] == [(Concatenate, 1)])
        plain = all(_PLAIN.match(p) and p.count("*") == 1 for p in sources) and len(targets) == 1 \
            and _PLAIN.match(targets[0]) and "*" not in targets[0]
        if not merged or not plain:
            continue  # not a view in reverse (a transpose, a split of q/k/v, a regex): left as it is
        rules.append(Unfuse(targets[0], tuple(sources), getattr(conv, "scope_prefix", None) or ""))
    return tuple(rules)


_RULES: dict[str, tuple[Unfuse, ...]] = {}  # (model_expert_rules': by path, for the process's life)


def model_expert_rules(path: str) -> tuple[Unfuse, ...]:
    """The rules of the transformers model at `path` (its config, built on the meta device: nothing allocated, no
    weights read); () for a model transformers cannot build, asked again next time (a replica's processes must not
    disagree over a passing failure)."""
    if path not in _RULES:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        except Exception:  # noqa: BLE001 - not a transformers model: its checkpoint's names are all there is
            return ()
        _RULES[path] = expert_rules(model)
    return _RULES[path]


def unfused(name: str, shape: tuple[int, ...], rules: Iterable[Unfuse]) \
        -> list[tuple[str, View, tuple[int, ...]]] | None:
    """The per-expert tensors a fused parameter is saved as (see Unfuse.parts), or None."""
    for rule in rules:
        if (parts := rule.parts(name, shape)) is not None:
            return parts
    return None


def checkpoint_tensors(tensors: Mapping[str, torch.Tensor], rules: Iterable[Unfuse]) -> dict[str, torch.Tensor]:
    """`tensors` (by parameter name) under checkpoint names, in order; fused experts as views (no copy)."""
    rules = tuple(rules)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = unfused(name, tuple(t.shape), rules)
        if parts is None:
            out[name] = t
        else:
            flat = t.detach()
            out.update((n, view.of(flat)) for n, view, _ in parts)
    return out


def checkpoint_groups(specs: Mapping[str, tuple[torch.Size, torch.dtype]], rules: Iterable[Unfuse]) \
        -> tuple[dict[str, tuple[torch.Size, torch.dtype]], dict[str, tuple[str, ...]]]:
    """(checkpoint specs in order, {parameter: the checkpoint names it is the consecutive run of}) for
    parameter specs: how a flat store laid out under checkpoint names holds the parameters."""
    rules = tuple(rules)
    out, groups = {}, {}
    for name, (shape, dtype) in specs.items():
        parts = unfused(name, tuple(shape), rules)
        if parts is None:
            out[name], groups[name] = (shape, dtype), (name,)
        else:
            out.update((n, (torch.Size(s), dtype)) for n, _, s in parts)
            groups[name] = tuple(n for n, _, _ in parts)
    return out, groups


def stacked_tensors(tensors: Mapping[str, torch.Tensor], rules: Iterable[Unfuse]) -> dict[str, torch.Tensor]:
    """`tensors` (by parameter name) with each fused experts parameter stacked (a view: no copy)."""
    rules = tuple(rules)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        parts = unfused(name, tuple(t.shape), rules)
        out[name] = t if parts is None else Stacked(parts[-1][1].chunks).of(t.detach())
    return out


class Unstacked(NamedTuple):
    """A manifest's tensors with each stacked one as its experts' tensors (stacked_specs)."""

    specs: tuple[Spec, ...]  # the manifest's
    flat: tuple[Spec, ...]  # every tensor a loader takes: a stacked one's experts' in its order ([e, k], e-major)
    members: dict[int, range]  # a stacked tensor's index in `specs` -> its experts' indices in `flat`


def stacked_specs(specs: Sequence[Spec], rules: Iterable[Unfuse]) -> Unstacked:
    """Which tensors of `specs` are stacked fused experts parameters ([E, n, R, ...] named as the parameter a rule
    fuses), and the checkpoint's tensors each stands for, each [R, ...] (its nbytes split evenly)."""
    from rlsync.transfer.manifest import Spec

    rules = tuple(rules)
    flat: list[Spec] = []
    members: dict[int, range] = {}
    for i, s in enumerate(specs):
        parts = unfused(s.name, (s.shape[0], s.shape[1] * s.shape[2], *s.shape[3:]), rules) \
            if len(s.shape) >= 3 else None
        if parts is None or parts[-1][1].chunks != s.shape[1]:
            flat.append(s)
            continue
        nbytes = s.nbytes // len(parts)
        members[i] = range(len(flat), len(flat) + len(parts))
        flat.extend(Spec(n, s.dtype, rows, nbytes) for n, _, rows in parts)
    return Unstacked(tuple(specs), tuple(flat) if members else tuple(specs), members)


def unstacked_items(tensors: Mapping[str, torch.Tensor], stack: Unstacked) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `tensors` (by the manifest's names) as loaders take them: a stacked tensor as its experts'
    tensors, in order (views)."""
    for i, s in enumerate(stack.specs):
        t, members = tensors[s.name], stack.members.get(i)
        if members is None:
            yield s.name, t
        else:
            yield from ((stack.flat[j].name, t[divmod(m, s.shape[1])]) for m, j in enumerate(members))


def stacked_boxes(stack: Unstacked, boxes: Sequence[Box | None]) -> list[Box | None]:
    """Boxes of `stack.flat`'s tensors (None: none) as boxes of the manifest's: a stacked tensor's is the bounding
    box of its experts' boxes at their [e, k], the same box of each where they cover alike (tensor or expert
    parallel loaders)."""
    out: list[Box | None] = []
    at = 0  # (the flat index of the manifest's next tensor)
    for i, s in enumerate(stack.specs):
        members = stack.members.get(i)
        if members is None:
            out.append(boxes[at])
            at += 1
            continue
        at = members.stop
        held = [((m // s.shape[1], m % s.shape[1]), boxes[j]) for m, j in enumerate(members) if boxes[j] is not None]
        if not held:
            out.append(None)
            continue
        low = [min(c[d] for c, _ in held) for d in range(2)] + [min(b[d][0] for _, b in held)
                                                               for d in range(len(s.shape) - 2)]
        high = [max(c[d] for c, _ in held) + 1 for d in range(2)] + [max(b[d][1] for _, b in held)
                                                                     for d in range(len(s.shape) - 2)]
        out.append(tuple(zip(low, high)))
    return out


def stacked_views(stack: Unstacked, views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Views of `stack.flat`'s tensors (in the live weights, say) as views of the manifest's: a stacked tensor's
    where its experts' views are one contiguous run in its order ([E, n, R, ...] over them); None where one is not."""
    out = {}
    for i, s in enumerate(stack.specs):
        members = stack.members.get(i)
        if members is None:
            out[s.name] = views[s.name]
            continue
        parts = [views[stack.flat[j].name] for j in members]
        first, step = parts[0], parts[0].numel() * parts[0].element_size()
        if not all(p.is_contiguous() and p.dtype == first.dtype and p.untyped_storage().data_ptr()
                   == first.untyped_storage().data_ptr() and p.data_ptr() == first.data_ptr() + m * step
                   for m, p in enumerate(parts)):
            return None
        out[s.name] = first.as_strided(s.shape, row_major_strides(s.shape), first.storage_offset())
    return out

