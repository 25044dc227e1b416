"""A model's tensors under its checkpoint's names: fused expert parameters as per-expert views.

transformers 5 keeps a mixture of experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H])
while its checkpoints, and the engines that load them (vLLM, SGLang), name one tensor per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H]). The rules come from transformers' own conversion
mapping (the WeightConverters `from_pretrained` applies and `save_pretrained` reverses), read
here, not restated per architecture. Only the conversions whose reverse is a view are used:
MergeModulelist(dim=0) (expert e is `t[e]`), then optionally Concatenate(dim=1) (source k of n is
the k-th of n equal row blocks of `t[e]`). A per-expert tensor is then a contiguous view of the
fused one: nothing is copied, and a fused parameter is the consecutive run of its experts' tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

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


def has_fused_experts(path: str) -> bool:
    """Whether the model at `path` keeps experts fused in memory (built on the meta device: nothing
    allocated, no weights read); False for a model transformers cannot build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - not a transformers model: the trainer says why when it loads it
        return False
    rules = expert_rules(model)
    return any(unfused(n, tuple(p.shape), rules) for n, p in model.named_parameters())
