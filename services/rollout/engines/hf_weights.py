"""The hf engine's weights: parameters as views into one flat buffer per dtype.

Flat storage makes sleep/wake one large copy per dtype, and lets a weight update land in a second
set of buffers and become live by re-pointing the parameters (an O(1) swap between decode steps).
The store is laid out under the checkpoint's names (what trainers publish): a fused experts
parameter is the consecutive run of its experts' tensors (rlsync.checkpoint_names).
"""

from __future__ import annotations

import threading

import torch

from rlsync.checkpoint_names import checkpoint_groups, checkpoint_tensors, expert_rules
from rlsync.flat import FlatStore, specs_of
from rlsync.models import torch_dtype
from rlsync.rollout.engines.hf_fp8 import to_fp8
from rlsync.transfer.armed import Armed


class Weights:
    """The model and where its parameters live: on the device, in host backup, or dropped."""

    def __init__(self, model: torch.nn.Module, path: str, device: torch.device):
        self.model = model
        self.path = path
        self.device = device
        self.params = dict(model.named_parameters())  # tied parameters appear once
        self.shapes = {n: p.shape for n, p in self.params.items()}  # (an asleep parameter's data is empty)
        self.experts = expert_rules(model)
        # {checkpoint name: (shape, dtype)}, and the checkpoint names each parameter spans
        self.specs, self.groups = checkpoint_groups(specs_of(self.params), self.experts)
        # (a stacked manifest names each fused parameter: its run of checkpoint tensors in every store)
        self._spans = {p: names for p, names in self.groups.items() if len(names) > 1}
        self.store: FlatStore | None = None
        self.backup: FlatStore | None = None  # Sleep(level=1) on an accelerator: the weights, in host memory
        # The store the last swap retired: the next staged update lands in it (double buffering: no
        # store allocated or laid out per update). Kept while the batch leaves room for it.
        self.spare: FlatStore | None = None
        self._cast: tuple[list, int] = ([], 0)  # a manifest's specs, and what of them arrives in another dtype
        self._host: FlatStore | None = None  # pinned host memory for backups, allocated once
        # Woken but not yet refilled from the backup: the copy happens only if the weights are used
        # before an update replaces them (the colocated cycle never pays it).
        self.pending_restore = False
        self.receiving_in_place = False  # an update is landing straight in the woken store
        # A pull queued into the woken store at wake, waiting for the trainer's bell
        # (rlsync.transfer.armed); kept until the update it went to commits or anything else runs.
        self.armed: Armed | None = None
        # A pull queued into the spare while generating (Arming.arm_spare: hf_armed.ArmedSpare), which the next
        # update adopts; taken under the lock (the prepare's thread, or the engine's dropping the spare).
        self.armed_spare = None
        self._spare_lock = threading.Lock()
        self.from_checkpoint = True  # False once a weight update has replaced the checkpoint's values
        self.not_ready: str | None = None
        self.version = 0
        self.format = None  # the engine's WeightFormat (hf_fp8), None when unquantized
        self.sent = None  # the last update's manifest specs: audited under their names (FlatStore.views_for)
        self._place(self._pack(checkpoint_tensors(self.params, self.experts)))

    @classmethod
    def load(cls, path: str, device: torch.device, dtype: str) -> Weights:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
        fmt = to_fp8(model, path)  # an FP8 checkpoint: its layers hold the FP8 values again
        weights = cls(model.to(device).eval().requires_grad_(False), path, device)
        weights.format = fmt
        return weights

    def _pack(self, tensors: dict[str, torch.Tensor]) -> FlatStore:
        store = self.new_store(self.device)
        for name, view in store.views.items():
            view.copy_(tensors[name])
        return store

    def new_store(self, device: torch.device, pin: bool = False) -> FlatStore:
        """An empty store of the weights, laid out under the checkpoint's names (its spans: the fused parameters)."""
        return FlatStore(self.specs, device, pin=pin, spans=self._spans)

    def _place(self, store: FlatStore | None) -> None:
        """Points every parameter at its view in `store` (or at an empty tensor when None)."""
        self.store = store
        for name, p in self.params.items():
            p.data = store.span(self.groups[name], self.shapes[name]) if store is not None \
                else torch.empty(0, dtype=p.dtype, device=self.device)

    def device_bytes(self) -> int:
        return self.store.nbytes() if self.store is not None else 0

    def disarm(self) -> None:
        """Lets an armed copy run out (its bytes are overwritten before use unless an update took
        them), and one armed into the spare (it is the spare again). First in whatever else touches the store
        or waits for the whole device."""
        if self.armed is not None:
            self.armed.disarm()
            self.armed = None
        self.disarm_spare()

    def disarm_spare(self) -> None:
        """A copy armed into the spare runs out (nothing waits behind it after this); the store is the spare again."""
        spare = self.take_armed_spare()
        if spare is not None:
            spare.stop()
            self.give_back_spare(spare.store)

    def take_armed_spare(self):
        with self._spare_lock:
            spare, self.armed_spare = self.armed_spare, None
        return spare

    def sleep(self, level: int) -> int:
        """-> the bytes copied to host memory."""
        self.disarm()
        self.spare = None  # its memory goes back with the rest
        if self.store is None:
            return 0
        moved = 0
        if level == 1 and self.device.type != "cpu":
            if not self.pending_restore:  # else the backup still holds the weights
                self._host = self._host or self.new_store(torch.device("cpu"), pin=True)
                self._host.copy_from(self.store)
                torch.cuda.synchronize(self.device)
                self.backup, moved = self._host, self.store.nbytes()
        elif level == 1:
            return 0  # already in host memory: nothing to move off the device
        else:
            self.backup, self.pending_restore = None, False
        self._place(None)
        return moved

    def wake_up(self) -> None:
        if self.store is not None:
            return
        if self.backup is not None:
            self._place(self.new_store(self.device))
            self.pending_restore = True
        elif self.from_checkpoint:
            self._place(self._pack(self._read_checkpoint()))
        else:
            self._place(self.new_store(self.device))
            self.not_ready = ("weights were dropped by Sleep(level=2) after a weight update: push the "
                              "weights again (PrepareUpdate + CommitUpdate) before generating")

    def _read_checkpoint(self) -> dict[str, torch.Tensor]:
        from pathlib import Path

        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for f in sorted(Path(self.path).glob("*.safetensors")):
            tensors.update(load_file(f))
        missing = set(self.specs) - set(tensors)
        if missing:
            raise RuntimeError(f"checkpoint {self.path} lacks {sorted(missing)[:3]}")
        return tensors

    def ensure_restored(self) -> None:
        """Refills woken weights from the backup, before anything reads them."""
        if self.pending_restore and not self.receiving_in_place:
            self.disarm()
            self.store.copy_from(self.backup)
            self.backup, self.pending_restore = None, False

    def staging(self) -> FlatStore:
        """Where an update is received while these weights serve: the spare, else a new store."""
        spare = self.take_spare()
        return spare if spare is not None else self.new_store(self.device)

    def spare_bytes(self) -> int:
        """The spare's bytes on the device, armed or not."""
        spare = self.spare if self.spare is not None else getattr(self.armed_spare, "store", None)
        return spare.nbytes() if spare is not None else 0

    def take_spare(self) -> FlatStore | None:
        spare, self.spare = self.spare, None
        return spare

    def give_back_spare(self, store: FlatStore | None) -> None:
        """A spare taken and not committed: the spare again (unless another one took its place)."""
        if self.spare is None:
            self.spare = store

    def staging_bytes(self, specs) -> int:
        """What staging an update of `specs` (a manifest's) allocates: a store unless the spare is
        kept, and a buffer per tensor that arrives in another dtype (cast into it once complete)."""
        if self._cast[0] != specs:  # (the same manifest as last time: its specs compare by identity)
            store = self.store or self.spare or self.new_store(torch.device("meta"))
            own = store.views_for(specs)
            self._cast = (specs, sum(s.nbytes for s in specs if s.name in own and own[s.name].dtype != s.dtype))
        return self._cast[1] + (0 if self.spare is not None else self.device_bytes())

    def yield_spare(self, free: int, need: int) -> None:
        """Generation comes first: the spare is dropped when what the device can still allocate
        beside it (`free`) is less than what the batch may take next (`need`). The next update then
        allocates its staging, or is refused for room, as without a spare."""
        if free < need and (self.spare is not None or self.armed_spare is not None):
            self.disarm_spare()  # (its copy runs out first)
            self.spare = None

    def swap(self, store: FlatStore, version: int, specs=None) -> None:
        """Makes a fully received update live: the parameters point at it (O(1); nothing to do when
        it was received in place); the old store becomes the spare. (The caller disarmed and
        synchronized the device first: nothing reads the old store any more.) `specs`: its manifest's, whose
        names the weights are audited under from now on (stacked experts, say)."""
        self.sent = specs
        if store is not self.store:
            retired = self.store
            self._place(store)
            self.spare = retired
        self.backup, self.pending_restore, self.receiving_in_place = None, False, False
        self.from_checkpoint = False
        self.not_ready = None
        self.version = version

    def checksums(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        from rlsync.transfer import audit

        self.ensure_restored()
        if self.store is None:
            return audit({n: p.data for n, p in self.params.items()})
        return audit(self.store.views_for(self.sent) if self.sent is not None else self.store.views)

    def release(self) -> None:
        self.disarm()
        self._place(None)
        self.backup = self.spare = None
