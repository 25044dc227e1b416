"""rlsync's vLLM worker extension: methods vLLM mixes into each worker, reached with collective_rpc.

Registered through vLLM's public `worker_extension_cls` engine argument. Arguments and results are
plain ints, strings, bytes and dicts (tensors do not cross the engine's process boundary): each
worker receives the weights itself, straight from the trainer, into its own staging memory, and
loads them through the worker's reload path at commit; asleep on the GPU (the colocated cycle), it
receives straight into its live weights where vLLM's loaders place every tensor as one run of a
parameter (`vllm_direct`), and the commit loads nothing. From a sharded trainer (a routed offer) a
worker receives only the box of each tensor its loaders keep (`vllm_layout`), straight from the
trainer ranks that hold it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlsync.flat import flat_like
from rlsync.rollout.engines.process import prepare_engine_process
from rlsync.errors import ResourceExhausted
from rlsync.rollout.engines.vllm_direct import direct_views
from rlsync.rollout.engines.vllm_experts import first_load_processing, live_mismatches
from rlsync.rollout.engines.vllm_layout import BoxStaging, loaded_boxes
from rlsync.rollout.staging import StagedUpdate, ensure_room
from rlsync.transfer import answer, audit_entry, from_proto
from rlsync.transfer.checksum import box_sums
from rlsync.transfer.dtypes import dtype_name
from rlsync.transfer.handshake import local_facts
from rlsync.transfer.routes import relative, share
from rlsync.transfer.sharded import layout_of, to_layout_proto
from rlsync.transfer.v1 import transfer_pb2 as pb

log = logging.getLogger(__name__)

# vLLM imports this module in every worker process while it builds the worker, before any forward.
prepare_engine_process()


def refresh_tied(model: torch.nn.Module) -> int:
    """Re-runs weight post-processing for modules that share a weight with another module.

    vLLM's reload path re-processes the layers that received tensors. A tied LM head receives none
    (the checkpoint has no lm_head.weight), so on the CPU build its prepacked copy of the embedding
    would keep the old values while the embedding itself is new. Processing it again (its quant
    method's public process_weights_after_loading) repacks it from the shared, updated weight."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and getattr(module, "quant_method", None) is not None:
            owners.setdefault(id(weight), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


class RlsyncWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (self.model_runner, self.device, self.rank...)."""

    def rlsync_memory(self) -> dict[str, Any]:
        model = self.model_runner.get_model()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        kv = 0
        for cache in getattr(self.model_runner, "kv_caches", []) or []:
            tensors = cache if isinstance(cache, (list, tuple)) else [cache]
            kv += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        device = next(model.parameters()).device
        reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        update = getattr(self, "_rlsync_update", None)
        staging = 0 if update is None or getattr(update, "direct", False) else update.staging.nbytes() \
            if isinstance(update.staging, BoxStaging) \
            else sum(t.numel() * t.element_size() for t in update.staging.values())
        return {"device": str(device), "weights_bytes": weights, "kv_cache_bytes": kv, "reserved_bytes": reserved,
                "staging_bytes": staging}

    def _rlsync_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def rlsync_layout(self, offer: bytes) -> bytes:
        """The boxes of each tensor of a routed offer this worker's loaders keep (a RankLayout),
        found once per tensor list by running vLLM's own loaders on probes."""
        specs = from_proto(pb.Offer.FromString(offer).manifest)
        return to_layout_proto([[b] if b is not None else [] for b in self._rlsync_boxes(specs)],
                               local_facts(self._rlsync_device())).SerializeToString()

    def _rlsync_boxes(self, specs) -> list:
        key = tuple((s.name, s.shape) for s in specs)
        cached = getattr(self, "_rlsync_layout", None)
        if cached is None or cached[0] != key:
            self._rlsync_layout = cached = (key, loaded_boxes(self.model_runner.get_model(), specs))
        return cached[1]

    def rlsync_answer(self, offer: bytes, receiver_id: str, ranks: int, force: str,
                      layouts: list[bytes] | None = None) -> bytes:
        """This worker's choice of channel (its own device decides: same GPU as the trainer or not);
        for a routed offer, with every worker's boxes (`layouts`, by rank)."""
        ans = answer(pb.Offer.FromString(offer), receiver_id, device=self._rlsync_device(), ranks=ranks,
                     force=force or None, layout=[pb.RankLayout.FromString(b) for b in layouts] if layouts else None)
        return ans.SerializeToString()

    def _rlsync_direct_views(self, specs) -> dict[str, torch.Tensor] | None:
        """Views of the live parameters each checkpoint tensor loads into (vllm_direct), found once per
        tensor list; None where the loaders or the weights' processing do not allow it (said once)."""
        if self._rlsync_device().type != "cuda":  # (vLLM processes its weights off the GPU: never direct)
            return None
        key = tuple((s.name, s.shape) for s in specs)
        cached = getattr(self, "_rlsync_direct", None)
        if cached is None or cached[0] != key:
            try:
                views, why = direct_views(self.model_runner.get_model(), specs)
            except Exception as e:  # noqa: BLE001 - a loader that refuses meta probes: stage, as before
                views, why = None, f"vLLM's loaders refused the probes ({e!r})"
            if views is None:
                log.info("updates are staged, then loaded by vLLM's reload path: %s", why)
            self._rlsync_direct = cached = (key, views)
        return cached[1]

    def rlsync_begin(self, offer: bytes, answer_bytes: bytes, timeout: float, direct: bool = False,
                     staging_bytes: int = 0, receiver_id: str = "", force: str = "") -> dict:
        """Starts receiving, in the background (a pull is done when this returns): straight into the live
        weights where `direct` allows (the engine is asleep and its loaders place every tensor as one run
        of a parameter), else into staging memory (`staging_bytes` of it, refused first when they do not
        fit: "refused"): the whole checkpoint, or from a routed offer only this worker's boxes. Without an
        answer (a replica of one worker), it answers for itself first, and the state carries the answer.
        Returns its state, as rlsync_poll, with whether it landed directly."""
        o = pb.Offer.FromString(offer)
        device = self._rlsync_device()
        ans = pb.Answer.FromString(answer_bytes) if answer_bytes else \
            answer(o, receiver_id, device=device, force=force or None)
        state = self._rlsync_begin(o, ans, device, timeout, direct, staging_bytes)
        return state if answer_bytes else {**state, "answer": ans.SerializeToString()}

    def _rlsync_begin(self, o: pb.Offer, ans: pb.Answer, device: torch.device, timeout: float, direct: bool,
                      staging_bytes: int) -> dict:
        specs = from_proto(o.manifest)
        views = self._rlsync_direct_views(specs) if direct and not o.HasField("routing") else None
        if views is not None:
            self._rlsync_update = StagedUpdate(o, ans, views, self.rank, device, timeout, post=False)
            self._rlsync_update.direct = True
            state = self._rlsync_update.poll()
            if "stages" in state:  # (a mark: the transfer's profile says where the bytes went)
                state["stages"] = {**state["stages"], "in_place": 0.0}
            return {**state, "direct": True}
        try:
            ensure_room(staging_bytes, device, o.manifest.version)
        except ResourceExhausted as e:
            return {"state": "failed", "code": "ResourceExhausted", "error": str(e), "refused": True}
        if o.HasField("routing"):
            boxes = self._rlsync_boxes(specs)
            staging = BoxStaging(specs, boxes, device)
            self._rlsync_update = StagedUpdate(o, ans, staging.views(), self.rank, device, timeout,
                                               boxes=staging.boxes)
            self._rlsync_update.staging = staging
        else:
            self._rlsync_update = StagedUpdate(o, ans, flat_like(specs, device), self.rank, device, timeout)
        return self._rlsync_update.poll()

    def rlsync_poll(self) -> dict:
        update = getattr(self, "_rlsync_update", None)
        return update.poll() if update is not None else {"state": "none"}

    def rlsync_commit(self) -> None:
        """Loads the received tensors through vLLM's reload path (nothing to load for an update that landed
        straight in the live weights), and remembers their checksums (vLLM's CPU build prepacks linear weights,
        so the live ones cannot be read back); its prepacked experts are read back against vLLM's own processing
        of the tensors handed to it (vllm_experts), and a difference fails the commit. Boxes are handed to the
        loaders as full-shape views (BoxStaging.full), audited per box."""
        update = self._rlsync_update
        self._rlsync_update = None
        staging = update.staging
        if getattr(update, "direct", False):  # already in the live weights (on the GPU: direct_views)
            torch.cuda.synchronize(self._rlsync_device())
            # (read back from the live weights, in the engine's dtype: "live" tells the audit to compare so)
            self._rlsync_applied = {"live": {n: audit_entry(t) for n, t in staging.items()}}
            return
        model = self.model_runner.get_model()

        def handed():
            return staging.full() if isinstance(staging, BoxStaging) else iter(staging.items())

        with first_load_processing(model):  # (vLLM skips its experts' processing otherwise)
            self.reload_weights(weights_iterator=handed())
        if wrong := live_mismatches(model, handed()):  # what the experts compute with, read back
            raise RuntimeError(f"vLLM's live expert weights differ from its own processing of the tensors this "
                               f"update handed it ({', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''}): it "
                               "would compute with weights other than the ones verified")
        if isinstance(staging, BoxStaging):
            self._rlsync_applied = {"parts": self._rlsync_parts(update, staging)}
        else:
            self._rlsync_applied = {n: audit_entry(t) for n, t in staging.items()}
        refresh_tied(model)

    def _rlsync_parts(self, update: StagedUpdate, staging: BoxStaging) -> dict:
        """This worker's share of each tensor's checksum: the replica's workers split every tensor
        among them (routes from their boxes to one whole copy, so a box two workers hold counts once)
        and each adds up the sums of its part (checksum.box_sums); the replica adds the shares."""
        specs = from_proto(update.receiver.offer.manifest)
        views = staging.views()
        out = {s.name: [dtype_name(s.dtype), list(s.shape), s.nbytes, 0, 0] for s in specs}
        for p in share(layout_of(specs, update.receiver.answer.layout), self.rank):
            s = specs[p.tensor]
            region = relative(p.box, staging.boxes[s.name])
            values = views[s.name][tuple(slice(a, b) for a, b in region)] if region else views[s.name]
            s1, s2 = box_sums(values, p.box, s.shape)
            out[s.name][3] += s1
            out[s.name][4] += s2
        return out

    def rlsync_abort(self) -> None:
        update = getattr(self, "_rlsync_update", None)
        self._rlsync_update = None
        if update is not None:
            update.abort()

    def rlsync_applied(self) -> dict | None:
        return getattr(self, "_rlsync_applied", None)
