"""LoRA adapters on the wire: peft's names and layout, checked against a base before any byte moves.

A trainer that trains a LoRA adapter (peft) on a frozen base syncs only the adapter. The manifest
lists its tensors under the names peft saves them with, "base_model.model.<module>.lora_A.weight"
(rank x in) and "...lora_B.weight" (out x rank), where <module> is a linear layer named as in the
base checkpoint ("model.layers.0.self_attn.q_proj"), and carries a LoraAdapter message (rank, alpha).
Engines keep the base resident and serve base + adapter. The trainer's frozen base is never sent,
but audits cover it, so a checksum audit still compares the whole served policy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from rlsync.errors import InvalidArgument
from rlsync.transfer.v1 import transfer_pb2 as pb

PREFIX = "base_model.model."
_WIRE = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
# A live peft parameter: [base_model.model.]<module>.lora_A.<adapter>.weight
_LIVE = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.([^.]+)\.weight$")
_OTHER_PEFT = ("lora_embedding_", "lora_magnitude_vector", "modules_to_save", "lora_bias")


def wire_name(module: str, side: str) -> str:
    return f"{PREFIX}{module}.lora_{side}.weight"


def parse(name: str) -> tuple[str, str]:
    """A wire name -> (module, "A" or "B")."""
    m = _WIRE.match(name)
    if m is None:
        raise InvalidArgument(f"adapter tensor {name!r} is not named as peft saves LoRA weights "
                              "('base_model.model.<module>.lora_A.weight' or '.lora_B.weight')")
    return m.group(1), m.group(2)


def check(specs: Sequence, adapter: pb.LoraAdapter, base: Mapping[str, tuple[tuple[int, ...], object]],
          max_rank: int | None = None) -> dict[str, tuple[int, int]]:
    """Checks an adapter's tensors (transfer Specs) against the base's {name: (shape, _)}; returns
    {module: (out, in)} of the adapted modules. Raises InvalidArgument naming every problem."""
    if adapter.rank <= 0 or not math.isfinite(adapter.alpha) or adapter.alpha <= 0:
        raise InvalidArgument(f"LoRA adapter rank {adapter.rank} and alpha {adapter.alpha} must both be positive")
    if max_rank is not None and adapter.rank > max_rank:
        raise InvalidArgument(f"LoRA rank {adapter.rank} exceeds this replica's max_lora_rank {max_rank}: restart it "
                              f"with a larger one")
    problems, sides, modules = [], {}, {}
    for s in specs:
        module, side = parse(s.name)
        sides.setdefault(module, set()).add(side)
        weight = base.get(f"{module}.weight")
        if weight is None or len(weight[0]) != 2:
            problems.append(f"{s.name!r}: the base has no linear layer {module!r}")
            continue
        out, inp = weight[0]
        want = (adapter.rank, inp) if side == "A" else (out, adapter.rank)
        if tuple(s.shape) != want:
            problems.append(f"{s.name!r}: shape {list(s.shape)}, expected {list(want)} (rank {adapter.rank}, "
                            f"base {module}.weight {[out, inp]})")
        if not s.dtype.is_floating_point:
            problems.append(f"{s.name!r}: dtype {s.dtype} is not floating point")
        modules[module] = (out, inp)
    problems += [f"{module!r} lacks lora_{min({'A', 'B'} - got)}" for module, got in sides.items() if len(got) < 2]
    if not specs:
        problems.append("the adapter has no tensors")
    if problems:
        raise InvalidArgument(f"LoRA adapter refused ({len(problems)} problems): " + "; ".join(problems[:5]))
    return modules


# ---- the trainer's side: a peft model split into what is sent and what the receivers hold ------------
def adapter_of(model: torch.nn.Module) -> pb.LoraAdapter | None:
    """The adapter a peft model trains (None for any other model); refuses what rlsync cannot sync."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    if len(configs) > 1:
        raise InvalidArgument(f"the model has {len(configs)} adapters ({sorted(configs)}): publish one")
    config = next(iter(configs.values()))
    unsupported = [what for what, bad in [
        ("a peft method other than LoRA", str(getattr(config, "peft_type", "LORA")) not in ("LORA", "PeftType.LORA")),
        ("DoRA (use_dora)", getattr(config, "use_dora", False)),
        ("trained biases (bias != 'none')", getattr(config, "bias", "none") != "none"),
        ("modules_to_save", bool(getattr(config, "modules_to_save", None))),
        ("per-module ranks or alphas", bool(getattr(config, "rank_pattern", None)
                                            or getattr(config, "alpha_pattern", None))),
    ] if bad]
    if unsupported:
        raise InvalidArgument("LoRA sync supports plain LoRA on linear layers; this adapter uses "
                              + ", ".join(unsupported))
    return pb.LoraAdapter(rank=config.r, alpha=config.lora_alpha, use_rslora=bool(config.use_rslora))


def split(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A peft model's tensors by name -> ({wire name: adapter tensor}, {base checkpoint name: frozen tensor})."""
    adapter, base, other = {}, {}, []
    for name, t in tensors.items():
        m = _LIVE.match(name)
        if m is not None:
            adapter[wire_name(m.group(1), m.group(2))] = t
        elif any(k in name for k in _OTHER_PEFT) or t.requires_grad:  # trained, so it would have to be sent
            other.append(name)
        else:
            base[name.removeprefix(PREFIX).replace(".base_layer.", ".")] = t
    if other:
        raise InvalidArgument(f"LoRA sync sends the LoRA weights of linear layers only; the model also trains "
                              f"{other[:3]} (freeze them, or publish the whole model)")
    return adapter, base


def peft_config(adapter: pb.LoraAdapter, modules: Sequence[str]):
    """peft's LoraConfig for an adapter on these modules (full paths, as in the base)."""
    from peft import LoraConfig

    return LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, use_rslora=adapter.use_rslora,
                      target_modules=sorted(modules), lora_dropout=0.0, bias="none")
