"""gRPC face of the rollout core: protobuf <-> domain types, nothing else."""

from __future__ import annotations

import time

import grpc

from rlsync.common.audit import to_proto as checksums_to_proto
from rlsync.common.v1 import generate_pb2 as gen_pb
from rlsync.errors import InvalidArgument
from rlsync.rollout.core import Info, RolloutCore
from rlsync.rollout.types import (DEFAULT_MAX_TOKENS, Chunk, MemoryUsage, PauseMode, SamplingParams,
                                  WakeTag)
from rlsync.rollout.v1 import rollout_pb2 as pb
from rlsync.rollout.v1 import rollout_pb2_grpc
from rlsync.rpc import streaming, unary
from rlsync.transfer.handshake import host_id
from rlsync.transfer.v1.transfer_pb2 import Doorbell

_PAUSE_MODES = {pb.PAUSE_MODE_ABORT: PauseMode.ABORT, pb.PAUSE_MODE_KEEP: PauseMode.KEEP,
                pb.PAUSE_MODE_WAIT: PauseMode.WAIT}
_TAGS = {pb.WAKE_TAG_WEIGHTS: WakeTag.WEIGHTS, pb.WAKE_TAG_KV_CACHE: WakeTag.KV_CACHE}
_TAG_PROTO = {v: k for k, v in _TAGS.items()}
_STATES = {"serving": pb.SERVING_STATE_SERVING, "paused": pb.SERVING_STATE_PAUSED,
           "sleeping": pb.SERVING_STATE_SLEEPING, "dead": pb.SERVING_STATE_DEAD}


def sampling_from_proto(p: gen_pb.SamplingParams) -> SamplingParams:
    def get(name, default):
        return getattr(p, name) if p.HasField(name) else default

    return SamplingParams(
        max_tokens=get("max_tokens", DEFAULT_MAX_TOKENS), temperature=get("temperature", 1.0),
        top_p=get("top_p", 1.0), top_k=get("top_k", 0), stop=tuple(p.stop), seed=get("seed", None),
        ignore_eos=p.ignore_eos, n=get("n", 1), logprobs=p.logprobs)


def chunk_to_proto(c: Chunk) -> gen_pb.GenerateChunk:
    out = gen_pb.GenerateChunk(
        request_id=c.request_id, index=c.index, token_ids=c.token_ids, text=c.text,
        logprobs=c.logprobs or [], weight_version=c.weight_version,
        finish_reason=int(c.finish) if c.finish is not None else 0, finish_detail=c.detail,
        prompt_token_ids=c.prompt_token_ids)
    if c.finish is not None:
        out.version_spans.extend(gen_pb.VersionSpan(weight_version=v, start=s, length=n) for v, s, n in c.version_spans)
        versions = [v for v, _, _ in c.version_spans] or [c.weight_version]
        out.min_weight_version, out.max_weight_version = min(versions), max(versions)
    return out


def memory_to_proto(m: MemoryUsage) -> pb.MemoryUsage:
    return pb.MemoryUsage(device=m.device, weights_bytes=m.weights_bytes, kv_cache_bytes=m.kv_cache_bytes,
                          device_reserved_bytes=m.device_reserved_bytes, staging_bytes=m.staging_bytes,
                          spare_bytes=m.spare_bytes)


def info_to_proto(i: Info) -> pb.RolloutInfo:
    return pb.RolloutInfo(
        engine=i.engine, model=i.model, weight_version=i.weight_version, state=_STATES[i.state],
        in_flight=i.in_flight, asleep=[_TAG_PROTO[t] for t in sorted(i.asleep, key=lambda t: t.value)],
        max_model_len=i.max_model_len, tensor_parallel_size=i.tensor_parallel_size, replica_id=i.replica_id,
        memory=memory_to_proto(i.memory), vocab_size=i.vocab_size, pending_version=i.pending_version, dtype=i.dtype,
        dead_reason=i.dead_reason, requests_admitted=i.requests_admitted, received_bytes=i.received_bytes,
        doorbell=Doorbell(host_id=host_id(), address=i.doorbell, name=i.replica_id) if i.doorbell else None,
        weight_format=i.weight_format)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, core: RolloutCore):
        self.core = core

    @streaming
    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        kind = request.WhichOneof("prompt")
        gen = self.core.make_request(
            request.request_id, request.text if kind == "text" else None,
            list(request.token_ids.ids) if kind == "token_ids" else None, sampling_from_proto(request.sampling),
            [(m.role, m.content) for m in request.chat.messages] if kind == "chat" else None)
        async for chunk in self.core.generate(gen):
            yield chunk_to_proto(chunk)

    @unary
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        await self.core.abort(request.request_id)
        return pb.AbortResponse()

    @unary
    async def Pause(self, request: pb.PauseRequest, context) -> pb.PauseResponse:
        if request.mode not in _PAUSE_MODES:
            raise InvalidArgument("Pause needs a mode: PAUSE_MODE_ABORT, PAUSE_MODE_KEEP or PAUSE_MODE_WAIT")
        aborted, in_flight = await self.core.pause(_PAUSE_MODES[request.mode])
        return pb.PauseResponse(aborted=aborted, in_flight=in_flight)

    @unary
    async def Resume(self, request: pb.ResumeRequest, context) -> pb.ResumeResponse:
        await self.core.resume()
        return pb.ResumeResponse()

    @unary
    async def Sleep(self, request: pb.SleepRequest, context) -> pb.SleepResponse:
        aborted = await self.core.sleep(request.level)
        return pb.SleepResponse(aborted=aborted, memory=memory_to_proto(await self.core.engine.memory()))

    @unary
    async def WakeUp(self, request: pb.WakeUpRequest, context) -> pb.WakeUpResponse:
        unknown = [t for t in request.tags if t not in _TAGS]
        if unknown:
            raise InvalidArgument(f"unknown wake tag(s) {unknown}: use WAKE_TAG_WEIGHTS or WAKE_TAG_KV_CACHE")
        await self.core.wake_up(frozenset(_TAGS[t] for t in request.tags))
        return pb.WakeUpResponse(memory=memory_to_proto(await self.core.engine.memory()))

    @unary
    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.RolloutInfo:
        return info_to_proto(await self.core.info())

    @unary
    async def PrepareUpdate(self, request: pb.PrepareUpdateRequest, context) -> pb.PrepareUpdateResponse:
        return await self.prepare(request)

    async def prepare(self, request: pb.PrepareUpdateRequest) -> pb.PrepareUpdateResponse:
        """PrepareUpdate, by gRPC or rung at the replica's doorbell."""
        if not request.HasField("offer"):
            raise InvalidArgument("PrepareUpdate needs the trainer's offer (TrainerService.OfferWeights)")
        answer = await self.core.prepare_update(request.offer, request.force_backend, request.timeout, request.force)
        return pb.PrepareUpdateResponse(answer=answer)

    @unary
    async def HoldWeights(self, request: pb.HoldWeightsRequest, context) -> pb.HoldWeightsResponse:
        return await self.hold(request)

    async def hold(self, request: pb.HoldWeightsRequest) -> pb.HoldWeightsResponse:
        """HoldWeights, by gRPC or rung at the doorbell (a trainer on this GPU, at its onload)."""
        start = time.perf_counter()
        mapped, held, bell, peer_gpu = await self.core.hold_weights(
            request.holder, list(request.mapped.ipc), request.facts,
            request.routing if request.HasField("routing") else None)
        return pb.HoldWeightsResponse(mapped=mapped, held=held, seconds=time.perf_counter() - start, bell=bell,
                                      peer_gpu=peer_gpu)

    @unary
    async def ReleaseWeights(self, request: pb.ReleaseWeightsRequest, context) -> pb.ReleaseWeightsResponse:
        return await self.release(request)

    async def release(self, request: pb.ReleaseWeightsRequest) -> pb.ReleaseWeightsResponse:
        """ReleaseWeights, by gRPC or rung at the doorbell (the trainer, before it offloads)."""
        return pb.ReleaseWeightsResponse(released=await self.core.release_weights(request.holder))

    def doorbell_handlers(self) -> dict:
        """What a trainer on this host may ring at the doorbell: the same requests and responses."""
        return {"PrepareUpdate": (pb.PrepareUpdateRequest.FromString, self.prepare),
                "HoldWeights": (pb.HoldWeightsRequest.FromString, self.hold),
                "ReleaseWeights": (pb.ReleaseWeightsRequest.FromString, self.release)}

    @unary
    async def CommitUpdate(self, request: pb.CommitUpdateRequest, context) -> pb.CommitUpdateResponse:
        r = await self.core.commit_update(request.version, request.force, request.timeout, request.recompute_kv)
        return pb.CommitUpdateResponse(version=r.version, wait_seconds=r.wait_seconds, switch_seconds=r.switch_seconds,
                                       changed=r.changed, recomputed=r.recomputed, stages=r.stages)

    @unary
    async def AbortUpdate(self, request, context) -> pb.AbortUpdateResponse:
        return pb.AbortUpdateResponse(aborted=await self.core.abort_update())

    @unary
    async def GetWeightChecksums(self, request, context):
        version, sums, source = await self.core.checksums()
        return checksums_to_proto(version, sums, source)
