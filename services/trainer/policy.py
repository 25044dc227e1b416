"""The policy's memory: parameters in flat storage, optimizer state, an optional frozen reference,
and offload/onload that really frees the training device (GPU -> pinned host memory; CPU -> a
spool file on disk, so the process's resident memory drops too)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path

import torch

from rlsync.common.timing import Stopwatch
from rlsync.checkpoint_names import checkpoint_tensors, expert_rules, stacked_tensors
from rlsync.flat import FlatStore, specs_of
from rlsync.lora import split as lora_split
from rlsync.models import load_trainable
from rlsync.transfer import SharedArena
from rlsync.transfer.v1.transfer_pb2 import LoraAdapter


class _Stash:
    """Where an offloaded tensor waits: pinned host memory for a GPU tensor, a file for a CPU one."""

    def __init__(self, t: torch.Tensor, spool: Path, pinned: dict):
        self.dtype, self.shape, self.device = t.dtype, t.shape, t.device
        if t.device.type == "cuda":
            key = (tuple(t.shape), t.dtype)  # pinned buffers are reused: allocating them is slow
            free = pinned.setdefault(key, [])
            self.host = free.pop() if free else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._pool = free
            # Queued: the offload waits for every copy at once. t's memory is not reused before its copy:
            # frees are ordered on the stream t was made on, which is the trainer's one (current) stream.
            self.host.copy_(t, non_blocking=True)
            self.path = None
        else:
            self.host = None
            self.path = spool / f"{uuid.uuid4().hex}.bin"
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tofile(self.path)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def restore_into(self, out: torch.Tensor) -> torch.Tensor:
        """Queues the copy back (the onload waits for them all before the pinned buffer is reused)."""
        if self.host is not None:
            out.copy_(self.host, non_blocking=True)
            self._pool.append(self.host)
        else:
            with open(self.path, "rb") as f:
                f.readinto(out.reshape(-1).view(torch.uint8).numpy())
            self.path.unlink()
        return out

    def restore(self) -> torch.Tensor:
        return self.restore_into(torch.empty(self.shape, dtype=self.dtype, device=self.device))


class Policy:
    """`lora`: train that adapter (peft) on the frozen model; then only the adapter has gradients,
    optimizer state and a reference copy, and only it is published."""

    def __init__(self, model_path: str, device: str, dtype: str, lr: float, weight_decay: float, spool_dir: str,
                 lora: LoraAdapter | None = None, lora_targets: str = "all-linear"):

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0" when comparing
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = load_trainable(model_path, dtype).to(self.device)
        self.adapter = lora
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            targets = lora_targets if lora_targets == "all-linear" else [t.strip() for t in lora_targets.split(",")]
            self.model = get_peft_model(self.model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                               use_rslora=lora.use_rslora, target_modules=targets))
        self.model.train()
        self.params = dict(self.model.named_parameters())  # tied parameters appear once
        self.trainable = {n: p for n, p in self.params.items() if p.requires_grad}
        # (sent, frozen): the same Parameter objects for good (offload re-points their data, not them)
        self._published = lora_split(self.params) if lora is not None else (self.params, {})
        # Fused experts go out as views: stacked, or per expert under the checkpoint's names (published)
        self.experts = expert_rules(self.model) if lora is None else ()
        self.specs = specs_of(self.params)
        self.trainable_specs = specs_of(self.trainable)
        self.arena: SharedArena | None = None
        self.store = self._new_store()
        for name, view in self.store.views.items():
            view.copy_(self.params[name].data)
        self._point(self.store)
        self.optimizer = torch.optim.AdamW(self.trainable.values(), lr=lr, weight_decay=weight_decay)
        self.reference: FlatStore | None = None
        self.offloaded = False
        self._stashed: dict = {}
        self._pinned: dict = {}
        self.switch_profile: dict[str, dict[str, float]] = {}  # the last offload's and onload's stages
        self.spool = Path(spool_dir) if spool_dir else Path(tempfile.mkdtemp(prefix="rlsync-spool-"))
        self.spool.mkdir(parents=True, exist_ok=True)
        if not spool_dir:  # a folder of its own making goes with it (at exit at the latest); a given one stays
            weakref.finalize(self, shutil.rmtree, self.spool, ignore_errors=True)

    def _new_store(self) -> FlatStore:
        """Flat parameter storage; on CPU inside shared memory, so a same-host receiver copies once."""
        if self.device.type == "cpu":
            self.arena = SharedArena()
            return FlatStore(self.specs, allocate=self.arena.empty)
        return FlatStore(self.specs, self.device)

    def _point(self, store: FlatStore | None) -> None:
        for name, p in self.params.items():
            p.data = store.views[name] if store is not None else torch.empty(0, dtype=p.dtype, device=self.device)

    def reference_model_params(self) -> dict[str, torch.Tensor]:
        """A frozen copy of the trained parameters as they are now (made once, for the KL penalty)."""
        if self.reference is None:
            self.reference = FlatStore(self.trainable_specs, self.device)
            for name, view in self.reference.views.items():
                view.copy_(self.store.views[name])
        return self.reference.views

    def published(self, stacked: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(what a sync sends, what receivers already hold): every parameter and nothing, or under
        LoRA the adapter (peft's names) and its frozen base (the checkpoint's names). Fused experts
        are views of the parameters' data as it is now (taken again after an onload moved it): stacked
        where the replicas take them so (`stacked`), else per expert under the checkpoint's names."""
        sent, frozen = self._published
        if not self.experts:
            return sent, frozen
        return (stacked_tensors if stacked else checkpoint_tensors)(sent, self.experts), frozen

    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def device_bytes(self) -> int:
        """Parameters, gradients, optimizer state and reference resident on the training device."""
        total = self.store.nbytes() if self.store is not None else 0
        total += self.reference.nbytes() if self.reference is not None else 0
        for p in self.params.values():
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device == self.device and v.dim() > 0:  # not step counters
                    total += v.numel() * v.element_size()
        return total

    # ---- offload / onload ----------------------------------------------------------------------
    def offload(self) -> None:
        if self.offloaded:
            return
        clock = Stopwatch()
        self.optimizer.zero_grad(set_to_none=True)
        for group, store in {"params": self.store, "reference": self.reference}.items():
            if store is not None:
                self._stashed[group] = {d: _Stash(b, self.spool, self._pinned) for d, b in store.buffers.items()}
        self.reference = None
        self._stashed["optimizer"] = {}
        for i, state in enumerate(self.optimizer.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device == self.device and v.dim() > 0:
                    self._stashed["optimizer"][(i, k)] = _Stash(v, self.spool, self._pinned)
                    state[k] = torch.empty(0, dtype=v.dtype, device=self.device)
        self._point(None)
        self.store = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.offloaded = True
        clock.lap("queue")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every copy to pinned memory done
            clock.lap("copy")
            torch.cuda.ipc_collect()  # memory receivers mapped (CUDA IPC) is only freed once collected
            torch.cuda.empty_cache()
            clock.lap("release")
        self.switch_profile["offload"] = {**clock.stages, "bytes_to_host": self._stashed_bytes()}

    def _stashed_bytes(self) -> int:
        return sum(stash.nbytes for group in self._stashed.values() for stash in group.values())

    def onload(self) -> None:
        if not self.offloaded:
            return
        clock = Stopwatch()
        moved = self._stashed_bytes()
        self.store = self._new_store()
        for dtype, stash in self._stashed.pop("params").items():
            stash.restore_into(self.store.buffers[dtype])
        self._point(self.store)
        if "reference" in self._stashed:
            self.reference = FlatStore(self.trainable_specs, self.device)
            for dtype, stash in self._stashed.pop("reference").items():
                stash.restore_into(self.reference.buffers[dtype])
        states = list(self.optimizer.state.values())
        for (i, k), stash in self._stashed.pop("optimizer").items():
            states[i][k] = stash.restore()
        clock.lap("queue")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # back on the GPU, and the pinned buffers free to reuse
            clock.lap("copy")
        self.offloaded = False
        self.switch_profile["onload"] = {**clock.stages, "bytes_to_device": moved}

    def close(self) -> None:
        for group in self._stashed.values():
            for stash in group.values():
                if stash.path is not None and stash.path.exists():
                    os.unlink(stash.path)
        if self.arena is not None:
            self._point(None)
            self.store = None
            self.arena.close()
