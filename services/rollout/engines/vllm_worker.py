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

import concurrent.futures
import logging
import threading
import time
from typing import Any, NamedTuple

import torch

from rlsync.checkpoint_names import Unstacked, model_expert_rules, stacked_boxes, stacked_specs, stacked_views, \
    unstacked_items
from rlsync.flat import flat_like
from rlsync.rollout.engines.process import prepare_engine_process
from rlsync.errors import ResourceExhausted, Unmappable
from rlsync.rollout.engines.vllm_direct import direct_views
from rlsync.rollout.engines.vllm_experts import Copies, Placement, apart_copies, expert_layers, placement, reload, \
    stacked_placement
from rlsync.rollout.engines.vllm_layout import BoxStaging, Loads, probe_loads
from rlsync.rollout.engines.vllm_trace import mark, trace
from rlsync.rollout.engines.vllm_versions import TokenCounts
from rlsync.rollout.staging import StagedUpdate, ensure_room
from rlsync.transfer import answer, audit, batched, from_proto
from rlsync.transfer.armed import Bell
from rlsync.transfer.checksum import KeptAudit, share_sums, tensor_sums
from rlsync.transfer.dtypes import dtype_name
from rlsync.transfer.handshake import NAMES, local_facts, same_gpu
from rlsync.transfer.receiver import Receiver
from rlsync.transfer.held import HELD
from rlsync.transfer.routes import relative, share
from rlsync.transfer.sharded import layout_of, to_layout_proto
from rlsync.transfer.spans import copy_all
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


_AUDIT_PROGRAMS = 16  # of the checksum kernel: an H200's 132 SMs less these stay the engine's steps


class LiveAudit:
    """The audit of weights an update just made live, read back from them in a thread and on a stream of its
    own, so the engine generates on meanwhile (one launch for all its tensors, laid out once while they stay in
    place: rlsync.transfer.checksum.KeptAudit). The weights stay as they are until the next update or sleep,
    which wait for it first (`settle`)."""

    def __init__(self, kept: KeptAudit, device: torch.device):
        # Its stream reads after the copies into them (and the step before them: the commit may come while a
        # step still runs on the GPU, which the engine's thread does not wait for here)
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(device))
        self.future: concurrent.futures.Future[dict] = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(kept, device, written), name="rlsync-audit", daemon=True).start()

    def _run(self, kept: KeptAudit, device: torch.device, written: torch.cuda.Event) -> None:
        began = time.perf_counter()
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_event(written)
            with torch.cuda.stream(stream):
                self.future.set_result(kept())
        except BaseException as e:  # noqa: BLE001 - handed to whoever asks for the audit
            self.future.set_exception(e)
        mark("audit", began, time.perf_counter())  # (a bench's trace: beside the steps it runs with)

    def settle(self) -> None:
        self.future.exception()  # (its failure is the audit's answer, not the next update's)


class ArmedUpdate(NamedTuple):
    """An update that the copy armed at a wake moved into the live weights (rlsync_arm), as a direct pull
    does: what the commit reads of it."""

    staging: dict[str, torch.Tensor]  # the live weights' views
    receiver: Receiver  # the pull it repeated
    direct: bool = True


class RlsyncWorkerExtension:
    """Mixed into vLLM's Worker class: `self` is the worker (self.model_runner, self.device, self.rank...)."""

    def rlsync_trace(self, path: str) -> None:
        """Times this worker's model steps into `path` (vllm_trace: for benches)."""
        for method in ("execute_model", "sample_tokens"):
            if hasattr(self, method):
                trace(self, method, method, path)

    def rlsync_count_tokens(self) -> str:
        """Starts counting each request's sampled tokens for the commits (TokenCounts) -> "" where this worker
        counts exactly, else why not (the replica then pauses generation for each commit)."""
        why = TokenCounts.exact(self)
        if not why and getattr(self, "_rlsync_tokens", None) is None:
            self._rlsync_tokens = TokenCounts(self)
        return why

    def rlsync_tokens(self) -> dict[str, int]:
        """{vLLM's request id: tokens sampled so far} (TokenCounts), read between two engine steps."""
        return self._rlsync_tokens.now()

    def rlsync_memory(self) -> dict[str, Any]:
        model = self.model_runner.get_model()
        counted = getattr(self, "_rlsync_weights_bytes", None)  # (the same model's: at every commit's answer)
        if counted is None or counted[0] is not model:
            counted = self._rlsync_weights_bytes = model, sum(p.numel() * p.element_size() for p in model.parameters())
        weights = counted[1]
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
        kept = getattr(self, "_rlsync_kept", None)
        return {"device": str(device), "weights_bytes": weights, "kv_cache_bytes": kv, "reserved_bytes": reserved,
                "staging_bytes": staging, "spare_bytes": kept.nbytes() if kept is not None else 0}

    def _rlsync_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    def rlsync_layout(self, offer: bytes) -> bytes:
        """The boxes of each tensor of a routed offer this worker's loaders keep (a RankLayout),
        found once per tensor list by running vLLM's own loaders on probes."""
        specs = from_proto(pb.Offer.FromString(offer).manifest)
        return to_layout_proto([[b] if b is not None else [] for b in self._rlsync_loads(specs).boxes],
                               local_facts(self._rlsync_device())).SerializeToString()

    def _rlsync_loads(self, specs) -> Loads:
        """What this worker's loaders do with the tensors of `specs` (probe_loads): found once per tensor list. A
        stacked experts tensor's box is the bounding box of its experts' (checkpoint_names.stacked_boxes); the names
        that load into the expert layers are its experts' (the loaders' names)."""
        cached = getattr(self, "_rlsync_layout", None)
        if cached is not None and cached[2] is specs:  # (from_proto's tuple for the same tensors)
            return cached[1]
        key = tuple((s.name, s.shape) for s in specs)
        if cached is None or cached[0] != key:
            model = self.model_runner.get_model()
            stack = self._rlsync_stack(specs)
            flat = probe_loads(model, stack.flat, expert_layers(model))
            loads = Loads(stacked_boxes(stack, flat.boxes), flat.into_layers) if stack.members else flat
            cached = (key, loads, None, stack, flat)
        self._rlsync_layout = cached = (cached[0], cached[1], specs, *cached[3:])
        return cached[1]

    def _rlsync_stack(self, specs) -> Unstacked:
        """Which of `specs` are stacked experts, and their experts' tensors (stacked_specs), found once per list."""
        cached = getattr(self, "_rlsync_stacked", None)
        if cached is None or cached[0] is not specs:
            rules = model_expert_rules(self.model_config.model)
            self._rlsync_stacked = cached = (specs, stacked_specs(specs, rules))
        return cached[1]

    def rlsync_hold(self, holder: str, handles: list[bytes], facts: bytes) -> dict:
        """Keeps the storages of a trainer on this worker's GPU mapped for the pulls to come (rlsync.transfer.held):
        a pull then maps and closes nothing, and repeats the copy table it kept. -> {"mapped": newly mapped, "bell":
        the handle of this worker's bell, which the trainer writes to start a copy armed at a wake (rlsync_arm)}
        or {"refused": why not}."""
        self.rlsync_disarm()  # (before a storage an armed copy reads may close)
        device = self._rlsync_device()
        why = same_gpu(pb.Facts.FromString(facts), device)
        if why is None:
            try:
                mapped = HELD.hold(holder, handles, device)
            except Unmappable as e:
                why = str(e)
            else:
                if getattr(self, "_rlsync_bell", None) is None:
                    self._rlsync_bell = Bell(device)
                self._rlsync_held = list(handles)
                return {"mapped": mapped, "bell": self._rlsync_bell.handle}
        return {"refused": why}

    def rlsync_release(self, holder: str) -> int:
        self.rlsync_disarm()
        return HELD.release(holder)

    def rlsync_arm(self) -> dict:
        """At a wake of the weights while the KV cache sleeps (the colocated order: nothing runs on this GPU
        for the engine until the update): the last pull into the live weights again, from the storages held
        now, queued behind this worker's bell (rlsync.transfer.armed), which the trainer writes once its
        weights are final and before its offer reaches the replica. -> {"nbytes": what it copies, "event":
        the handle of the event after it, "offer" and "answer": the pull's (the replica adopts the copy for
        an offer of the same tensors from the same places)} or {"why": why nothing was armed}."""
        receiver, bell = getattr(self, "_rlsync_learnt", None), getattr(self, "_rlsync_bell", None)
        if receiver is None or bell is None:
            return {"why": "no pull from held storages into the live weights to repeat"}
        self.rlsync_disarm()
        armed = receiver.arm(bell, self._rlsync_held, cancellable=True)  # (the woken weights have no backup)
        if armed is None:
            return {"why": "its manifest carries checksums" if any(s.checksum for s in receiver.specs) else
                    "its tensors arrived in another dtype than the weights' and were cast on arrival (a trainer that "
                    "publishes in the engine's dtype has its updates armed)" if not all(receiver.writer.direct) else
                    "the last pull was not one launch of a kept table"}
        self._rlsync_armed = armed
        return {"nbytes": armed.nbytes, "event": bell.event_handle, "offer": receiver.offer.SerializeToString(),
                "answer": receiver.answer.SerializeToString()}

    def rlsync_disarm(self) -> bool:
        """Withdraws an armed copy (Armed.withdraw: emptied, so that it moves nothing unless the trainer started
        it): first in whatever else runs on the GPU or waits for the whole device -> whether it may have written
        the live weights (they then hold bytes no update verified)."""
        armed = getattr(self, "_rlsync_armed", None)
        self._rlsync_armed = None
        if armed is None:
            return False
        wrote = armed.withdraw()
        if wrote:
            log.warning("a copy armed at the wake wrote the live weights and no update took it: they are unfit to "
                        "serve until the next update")
        return wrote

    def _rlsync_unusable(self, o: pb.Offer) -> frozenset[int]:
        """The channels this worker found it cannot use with this sender (its memory would not map here)."""
        return frozenset({pb.BACKEND_CUDA_IPC}) if o.facts.SerializeToString() in self._rlsync_unmappable() else \
            frozenset()

    def _rlsync_unmappable(self) -> set[bytes]:
        """The facts of senders whose memory would not map here (kept on the worker, which has no __init__ of ours)."""
        return self.__dict__.setdefault("_rlsync_unmapped", set())

    def rlsync_answer(self, offer: bytes, receiver_id: str, ranks: int, force: str,
                      layouts: list[bytes] | None = None) -> bytes:
        """This worker's choice of channel (its own device decides: same GPU as the trainer or not);
        for a routed offer, with every worker's boxes (`layouts`, by rank)."""
        o = pb.Offer.FromString(offer)
        ans = answer(o, receiver_id, device=self._rlsync_device(), ranks=ranks, force=force or None,
                     layout=[pb.RankLayout.FromString(b) for b in layouts] if layouts else None,
                     unusable=self._rlsync_unusable(o))
        return ans.SerializeToString()

    def _rlsync_direct_views(self, specs) -> dict[str, torch.Tensor] | None:
        """Views of the live parameters each checkpoint tensor loads into (vllm_direct), found once per
        tensor list; None where the loaders or the weights' processing do not allow it (said once)."""
        if self._rlsync_device().type != "cuda":  # (vLLM processes its weights off the GPU: never direct)
            return None
        cached = getattr(self, "_rlsync_direct", None)
        if cached is not None and cached[2] is specs:  # (from_proto's tuple for the same tensors: every commit's)
            return cached[1]
        key = tuple((s.name, s.shape) for s in specs)
        if cached is None or cached[0] != key:
            stack = self._rlsync_stack(specs)
            try:
                views, why = direct_views(self.model_runner.get_model(), stack.flat)
            except Exception as e:  # noqa: BLE001 - a loader that refuses meta probes: stage, as before
                views, why = None, f"vLLM's loaders refused the probes ({e!r})"
            if views is not None and stack.members:  # (a stacked tensor: where its experts' views are one run)
                views = stacked_views(stack, views)
                why = "a stacked experts tensor's experts do not lie in one run of a parameter, in its order"
            if views is None:
                log.info("updates are staged, then loaded by vLLM's reload path: %s", why)
            cached = (key, views)
        self._rlsync_direct = (*cached[:2], specs)
        return cached[1]

    def rlsync_begin(self, offer: bytes, answer_bytes: bytes, timeout: float, direct: bool = False,
                     staging_bytes: int = 0, receiver_id: str = "", force: str = "", ranks: int = 1,
                     layouts: list[bytes] | None = None) -> dict:
        """Starts receiving, in the background (a pull is done when this returns): straight into the live
        weights where `direct` allows (the engine is asleep and its loaders place every tensor as one run
        of a parameter), else into staging memory (`staging_bytes` of it, refused first when they do not
        fit: "refused"; from a routed offer, 0: what its boxes take): the whole checkpoint, or from a routed offer
        only this worker's boxes. Without an answer, it answers for itself first (rlsync_answer's, for a replica of
        `ranks` workers whose boxes are `layouts`), and the state carries the answer; where the trainer's memory then
        does not map here, it answers again with another channel (said in the log; a replica of several workers
        leaves cuda_ipc out from its next answer on).
        Returns its state, as rlsync_poll (with the memory figures once it is not running: a pull's final
        state), with whether it landed directly and the seconds spent here."""
        entered = time.perf_counter()
        self.rlsync_disarm()  # (its copy would write the live weights under this update)
        o = pb.Offer.FromString(offer)
        device = self._rlsync_device()
        layout = [pb.RankLayout.FromString(b) for b in layouts] if layouts else None

        def answered(force: str | None) -> pb.Answer:
            return answer(o, receiver_id, device=device, ranks=ranks, force=force, layout=layout,
                          unusable=self._rlsync_unusable(o))

        ans = pb.Answer.FromString(answer_bytes) if answer_bytes else answered(force or None)
        state = self._rlsync_begin(o, ans, device, timeout, direct, staging_bytes)
        if ans.pull and state.get("code") == "Unmappable":  # nothing was read: another channel may do
            self._rlsync_unmappable().add(o.facts.SerializeToString())
            if not answer_bytes and not force:
                ans = answered(None)
                log.warning("%s: version %d comes over %s instead, and so do the next from this trainer",
                            state["error"], o.manifest.version, NAMES[ans.backend])
                state = self._rlsync_begin(o, ans, device, timeout, direct, staging_bytes)
        state = self._rlsync_final(state)  # (a pull that ended here: its final state, as rlsync_poll's, saves a poll)
        state["in_worker"] = time.perf_counter() - entered
        mark("worker_begin", entered, entered + state["in_worker"])  # (a bench's trace: between the steps around it)
        if "stages" in state:  # (what this call took beyond the receive's own stages: parsing, answering)
            state["stages"] = {**state["stages"], "worker": max(state["in_worker"] - sum(state["stages"].values()), 0)}
        return state if answer_bytes else {**state, "answer": ans.SerializeToString()}

    def _rlsync_begin(self, o: pb.Offer, ans: pb.Answer, device: torch.device, timeout: float, direct: bool,
                      staging_bytes: int) -> dict:
        specs = from_proto(o.manifest)
        kept, self._rlsync_kept = getattr(self, "_rlsync_kept", None), None  # (this update's, where it fits)
        views = self._rlsync_direct_views(specs) if direct and not o.HasField("routing") else None
        if views is not None:
            self.rlsync_settle()  # (the last audit reads them)
            self._rlsync_update = StagedUpdate(o, ans, views, self.rank, device, timeout, post=False)
            self._rlsync_update.direct = True
            state = self._rlsync_update.poll()
            if "stages" in state:  # (a mark: the transfer's profile says where the bytes went)
                state["stages"] = {**state["stages"], "in_place": 0.0}
            return {**state, "direct": True}
        staging = None
        if o.HasField("routing"):  # into the last update's staging where it is laid out alike (its memory is held)
            loads = self._rlsync_loads(specs)
            placed = self._rlsync_placement(specs, loads)
            stack = self._rlsync_stack(specs)
            staging = kept if kept is not None and kept.fits(specs, loads.boxes, device, placed, stack) else None
        del kept  # (one laid out otherwise is freed before a new one is allocated)
        if staging is None:
            if o.HasField("routing") and not staging_bytes:  # (unsaid: what this worker's boxes take)
                staging_bytes = BoxStaging.nbytes_of(specs, loads.boxes, placed, stack)
            try:
                ensure_room(staging_bytes, device, o.manifest.version)
            except ResourceExhausted as e:
                return {"state": "failed", "code": "ResourceExhausted", "error": str(e), "refused": True}
        if o.HasField("routing"):
            staging = staging or BoxStaging(specs, loads.boxes, device, placed, stack)
            self._rlsync_update = StagedUpdate(o, ans, staging, self.rank, device, timeout, boxes=staging.boxes,
                                               hold=o.routing.holder)
            self._rlsync_update.staging = staging
        else:
            self._rlsync_update = StagedUpdate(o, ans, flat_like(specs, device), self.rank, device, timeout)
        return self._rlsync_update.poll()

    def _rlsync_placement(self, specs, loads: Loads) -> Placement | None:
        """Where the staging lays out the expert layers' tensors so that the transfer loads them (placement), once
        the copies vLLM's loaders amount to for these tensors were learnt (_rlsync_copies); else None. Found for
        the loaders' tensors, then for stacked experts where each one's lies as its box stages it."""
        known, copies = getattr(self, "_rlsync_apart", (None, None))
        if known is not loads or copies is None:
            return None
        cached = getattr(self, "_rlsync_placed", None)
        if cached is None or cached[0] is not copies or cached[1] is not specs:
            _, _, _, stack, flat = self._rlsync_layout  # (the loaders' boxes of `loads`: _rlsync_loads)
            placed = stacked_placement(stack, placement(copies, stack.flat, flat.boxes), loads.boxes, flat.boxes)
            self._rlsync_placed = cached = (copies, specs, placed)
        return cached[2]

    def rlsync_poll(self) -> dict:
        """The update's state; once it is no longer running, with this worker's memory figures then (the
        engine asks for them in no call of its own: each call waits for an engine step)."""
        update = getattr(self, "_rlsync_update", None)
        return self._rlsync_final(update.poll() if update is not None else {"state": "none"})

    def _rlsync_final(self, state: dict) -> dict:
        """`state`, with this worker's memory figures once the update no longer runs."""
        return state if state.get("state") == "running" else {**state, "memory": self._rlsync_figures()}

    def rlsync_commit(self, rung: int = 0) -> dict[str, Any]:
        """Makes the received tensors live (_rlsync_commit), between two engine steps -> {"memory": this worker's
        figures after it (rlsync_memory), "tokens": each request's tokens sampled before it, by the old weights,
        "ended": those of them finished (rank 0, where it counts: TokenCounts)}: in one answer, as each call
        waits for an engine step. `rung`: the update is the copy armed at the wake (rlsync_arm), which the
        replica adopted for an offer rung with that bell value."""
        began = time.perf_counter()
        counts = getattr(self, "_rlsync_tokens", None)
        tokens = ended = None
        if counts is not None and self.rank == 0:
            tokens, ended = counts.now(), list(counts.finished)
        if rung:
            self._rlsync_adopt(rung)
        self._rlsync_commit()
        if ended:
            counts.forget(ended)
        out = {"memory": self._rlsync_figures(), "tokens": tokens, "ended": ended}
        mark("worker_commit", began, time.perf_counter())  # (a bench's trace: between the steps around it)
        return out

    def _rlsync_adopt(self, rung: int) -> None:
        """The armed copy as the update to commit, once it is known to be the one the trainer started for
        the offer rung with `rung` (a bell written for an earlier offer started it with older bytes)."""
        armed, receiver = getattr(self, "_rlsync_armed", None), getattr(self, "_rlsync_learnt", None)
        started = armed.bell.started_by() if armed is not None else 0
        self._rlsync_armed = None
        if armed is not None:
            armed.disarm()  # (done: the trainer waited for its event before the commit)
        if armed is None or receiver is None or started != rung:
            raise RuntimeError(f"the copy armed at the wake was started by bell value {started}, not {rung} (the "
                               "offer's): its bytes may be an earlier offer's" if armed is not None else
                               "no copy was armed at the wake for the replica to adopt")
        self._rlsync_update = ArmedUpdate(receiver.dest, receiver)

    def _rlsync_figures(self) -> dict[str, Any] | None:
        """rlsync_memory, best effort: a figure that cannot be read must not fail what it comes with."""
        try:
            return self.rlsync_memory()
        except Exception:  # noqa: BLE001 - the engine keeps its previous figures
            log.warning("could not read this worker's memory figures", exc_info=True)
            return None

    def _rlsync_commit(self) -> None:
        """Makes the received tensors live, between two engine steps: where vLLM's loaders place every tensor
        as one run of a parameter (on the GPU: vllm_direct), by one batched copy from staging into those runs
        (nothing at all for an update that landed in them already); else through vLLM's reload path. Remembers
        their checksums: of the live weights where they were copied into place, else as handed to the loaders
        (vLLM's CPU build prepacks linear weights, so the live ones cannot be read back). Expert layers whose
        experts process them (pad, prepack) go through vLLM's reload and are read back against its own processing
        of the tensors handed to it, and a difference fails the commit; once that read-back agreed for a list of
        tensors that fill them, the next updates of that list load them apart, processed by vLLM's experts and
        handed to its reload in kernel format (vllm_experts.reload). Boxes are handed to the loaders as full-shape
        views (BoxStaging.full), audited per box."""
        self.rlsync_settle()  # (the last commit's audit reads the weights this one changes)
        update = self._rlsync_update
        self._rlsync_update = None
        staging = update.staging
        direct = getattr(update, "direct", False)
        views = staging if direct else None  # already in the live weights
        # a direct pull from held storages: the next colocated wake may queue it again (rlsync_arm)
        self._rlsync_learnt = update.receiver if direct and update.receiver._held_pull else None
        staged = views is None and not isinstance(staging, BoxStaging)
        if staged:
            specs = from_proto(update.receiver.offer.manifest)
            views = self._rlsync_direct_views(specs)
        if views is not None:  # read back from the live weights, in the engine's dtype, while it generates on
            live = self._rlsync_audit(views)  # (laid out before the copy: if it fails, the weights are as they were)
            if staged:
                self._rlsync_copy_in(specs, staging, views)
            self._rlsync_applied = LiveAudit(live, self._rlsync_device())
            return
        model = self.model_runner.get_model()

        specs = from_proto(update.receiver.offer.manifest)

        def handed():  # (stacked experts as their experts' tensors: what the loaders take)
            return staging.full() if isinstance(staging, BoxStaging) else \
                unstacked_items(staging, self._rlsync_stack(specs))

        loads = self._rlsync_loads(specs) if expert_layers(model) else None
        experts = loads.into_layers if loads is not None else None
        # (the experts loaded apart once a commit of the same tensors read them back equal to vLLM's processing)
        known, copies = getattr(self, "_rlsync_apart", (None, None))
        blocks = staging.blocks() if isinstance(staging, BoxStaging) else None  # (the transfer loaded: placement)
        apart = experts is not None and known is loads
        if wrong := reload(self.reload_weights, model, handed, experts, apart, copies, blocks):  # (what it runs)
            raise RuntimeError(f"vLLM's live expert weights differ from its own processing of the tensors this "
                               f"update handed it ({', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''}): it "
                               "would compute with weights other than the ones verified")
        if experts and not apart:
            self._rlsync_apart = loads, self._rlsync_copies(model, [item for item in handed() if item[0] in experts])
        if isinstance(staging, BoxStaging):
            self._rlsync_applied = {"parts": self._rlsync_parts(update, staging)}
            self._rlsync_kept = staging  # (the next update of these tensors is received into it: rlsync_memory's spare)
        else:
            self._rlsync_applied = audit(staging)
        refresh_tied(model)

    def _rlsync_copy_in(self, specs, staging: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
        """Queues the copy of the staging of `specs` into the live weights' `views` (a cast where a dtype differs)
        on the engine's stream: the last commit's launch again (its table: batched.launch) where this staging lies
        where that one did (flat_like lays the same tensors out alike, and the allocator mostly hands it the same
        memory), else laid out anew (copy_all). Nothing of the staging is kept: its memory goes with the update."""
        at = tuple(t.data_ptr() for t in staging.values())
        kept = getattr(self, "_rlsync_copy", None)
        if kept is not None and kept[0] is views and kept[1] is specs and kept[2] == at:
            batched.launch(kept[3])
            return
        self._rlsync_copy = None
        same = [(src, views[name]) for name, src in staging.items() if src.dtype == views[name].dtype]
        table = copy_all((src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)) for src, dst in same)
        cast = False
        for name, src in staging.items():
            if src.dtype != views[name].dtype:  # (a manifest in another dtype than the engine's: cast)
                views[name].copy_(src)
                cast = True
        if table is not None and not cast:
            self._rlsync_copy = (views, specs, at, table)

    def _rlsync_audit(self, views: dict[str, torch.Tensor]) -> KeptAudit:
        """The audit of the live weights' `views`, laid out once while they stay where they are (KeptAudit)."""
        kept = getattr(self, "_rlsync_audits", None)
        if kept is None or not kept.fits(views):
            kept = self._rlsync_audits = KeptAudit(views, _AUDIT_PROGRAMS)
        return kept

    @staticmethod
    def _rlsync_copies(model: torch.nn.Module, handed: list) -> Copies | None:
        """apart_copies, after a commit that made the weights live: a failure to learn them must not fail it (the
        experts are then loaded apart by vLLM's loaders)."""
        try:
            return apart_copies(model, handed)
        except Exception:  # noqa: BLE001 - the weights are live and verified: only the shortcut is lost
            log.warning("could not learn the copies vLLM's loaders amount to for the expert layers", exc_info=True)
            return None

    def _rlsync_parts(self, update: StagedUpdate, staging: BoxStaging) -> dict:
        """This worker's share of each tensor's checksum: the replica's workers split every tensor
        among them (routes from their boxes to one whole copy, so a box two workers hold counts once)
        and each adds up the sums of its part (checksum.box_sums); the replica adds the shares. Which
        pieces, and their views of the staging, are found once per layout and kept with the staging."""
        specs = from_proto(update.receiver.offer.manifest)
        held = layout_of(specs, update.receiver.answer.layout)  # (the same Layout for the same ranks' layouts)
        kept = staging.memo.get(("parts", self.rank))
        if kept is None or kept[0] is not held:
            kept = staging.memo[("parts", self.rank)] = (held, _Parts(specs, held, self.rank, staging))
        return kept[1]()

    def rlsync_abort(self) -> None:
        self.rlsync_disarm()
        update = getattr(self, "_rlsync_update", None)
        self._rlsync_update = None
        if update is not None:
            update.abort()

    def rlsync_applied(self) -> dict | None:
        """The last commit's audit; {"pending": True} while it is still being read back (LiveAudit: asked
        again, not waited for here, where the engine would wait too)."""
        applied = getattr(self, "_rlsync_applied", None)
        if not isinstance(applied, LiveAudit):
            return applied
        if not applied.future.done():
            return {"pending": True}
        # ("live" tells the audit to compare in the engine's dtype)
        return {"live": applied.future.result()}

    def rlsync_before_sleep(self) -> None:
        """Before vLLM's sleep: the last commit's audit read (rlsync_settle), and the staging kept for the next
        update given back (a sleep frees the engine's memory for the trainer)."""
        self.rlsync_settle()
        self._rlsync_kept = None

    def rlsync_settle(self) -> None:
        """Waits for the last commit's audit to be read from the live weights, before anything changes them
        (and lets an armed copy run out: a sleep frees memory, which waits for the whole device)."""
        self.rlsync_disarm()
        applied = getattr(self, "_rlsync_applied", None)
        if isinstance(applied, LiveAudit):
            applied.settle()


class _Parts:
    """Worker `rank`'s share of the checksums (routes.share) in `staging`: its pieces' views, and their sums' plan
    (checksum.BoxSums), made once per layout."""

    def __init__(self, specs, held, rank: int, staging: BoxStaging):
        self.pieces = share(held, rank)
        self.values = []
        for p in self.pieces:
            name = specs[p.tensor].name
            region, view = relative(p.box, staging.boxes[name]), staging.views[name]
            self.values.append(view[tuple(slice(a, b) for a, b in region)] if region else view)
        self.sums = share_sums(self.pieces, [s.shape for s in specs])
        self.rows = [(s.name, dtype_name(s.dtype), list(s.shape), s.nbytes) for s in specs]

    def __call__(self) -> dict:
        """{tensor: [dtype, shape, nbytes, s1, s2]}: this worker's share of every tensor's sums."""
        sums = tensor_sums(self.pieces, self.sums(self.values), len(self.rows))
        return {name: [d, shape, nbytes, s1, s2] for (name, d, shape, nbytes), (s1, s2) in zip(self.rows, sums)}
