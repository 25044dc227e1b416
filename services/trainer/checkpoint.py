"""Checkpoints that resume bit-exactly: safetensors weights (a loadable model folder), optimizer
state, step and RNG state. Nothing is pickled."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlsync.errors import FailedPrecondition, InvalidArgument

WEIGHTS, OPTIMIZER, STATE = "model.safetensors", "optimizer.safetensors", "trainer_state.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "generation_config.json")


def _folder(path: str) -> Path:
    if not path or "\0" in path:
        raise InvalidArgument(f"checkpoint path {path!r} is empty or holds a NUL byte")
    return Path(path)


@contextlib.contextmanager
def _filesystem(doing: str, path: str) -> Iterator[None]:
    """A path the filesystem refuses (permissions, a file where a folder should be, a full disk)."""
    try:
        yield
    except OSError as e:
        raise FailedPrecondition(f"cannot {doing} {path}: {e.strerror or e}") from e


def save(path: str, policy, step: int, source_model: str) -> Path:
    out = _folder(path)
    with _filesystem("write a checkpoint to", path):
        return _save(out, policy, step, source_model)


def _save(out: Path, policy, step: int, source_model: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    params = {n: p.detach().contiguous() for n, p in policy.params.items()}
    save_file(params, str(out / WEIGHTS), metadata={"format": "pt", "rlsync_step": str(step)})
    names = {id(p): n for n, p in policy.params.items()}
    opt: dict[str, torch.Tensor] = {"__rng__": torch.get_rng_state()}
    for p, state in policy.optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                opt[f"{names[id(p)]}/{k}"] = v.detach().contiguous().cpu()
    save_file(opt, str(out / OPTIMIZER))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in policy.optimizer.param_groups]
    (out / STATE).write_text(json.dumps({"step": step, "param_groups": groups}, indent=1, default=str))
    if getattr(policy, "adapter", None) is not None:  # LoRA: the adapter as peft saves it, for the base model
        policy.model.save_pretrained(out / "adapter")  # (the weights above use peft's internal names: resume only)
    else:
        policy.model.config.save_pretrained(out)  # the folder is a model other tools can load
    for name in _TOKENIZER_FILES:
        if (Path(source_model) / name).exists():
            shutil.copy(Path(source_model) / name, out / name)
    return out


def load(path: str, policy) -> int:
    folder = _folder(path)
    with _filesystem("read a checkpoint from", path):
        return _load(folder, path, policy)


def _load(folder: Path, path: str, policy) -> int:
    if not (folder / WEIGHTS).exists() or not (folder / STATE).exists():
        raise InvalidArgument(f"{path} is not an rlsync checkpoint (needs {WEIGHTS} and {STATE})")
    if policy.offloaded:
        raise FailedPrecondition("trainer is offloaded: call Onload before LoadCheckpoint")
    weights = load_file(str(folder / WEIGHTS))
    missing = set(policy.params) - set(weights)
    wrong = [n for n, t in weights.items() if n in policy.params and t.shape != policy.params[n].shape]
    if missing or wrong:
        raise InvalidArgument(f"checkpoint does not match the model: missing {sorted(missing)[:3]}, "
                              f"wrong shapes {wrong[:3]}")
    with torch.no_grad():
        for n, p in policy.params.items():
            p.copy_(weights[n])
    opt = load_file(str(folder / OPTIMIZER))
    torch.set_rng_state(opt.pop("__rng__"))
    policy.optimizer.state.clear()
    for key, value in opt.items():
        name, _, k = key.rpartition("/")
        p = policy.params[name]
        policy.optimizer.state[p][k] = value.to(p.device) if value.dim() > 0 else value
    meta = json.loads((folder / STATE).read_text())
    for group, saved in zip(policy.optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                group[k] = v
    return int(meta["step"])
