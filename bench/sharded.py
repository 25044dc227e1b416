"""Sharded updates, side by side in one run: the rank-0 path (every tensor gathered to trainer rank 0,
then sent whole to every engine rank) against routes (every trainer rank sends its own pieces, every
engine rank receives only the boxes it loads), for K trainer ranks (FSDP2 over gloo) x g engine ranks
(tensor parallel as vLLM lays a decoder out: 2-D weights split by rows, 1-D whole).

    python bench/sharded.py                 # CPU, K in {1, 2, 4} x g in {1, 2}, preset "small"
    python bench/sharded.py --device cuda --preset qwen3-1.7b   # every process on one GPU: pulls
    python bench/sharded.py --device cuda --preset qwen3-1.7b --hold   # ... receivers keep the mappings; then
                                        # path armed: the repeat as a replica takes it (rlsync.transfer.relaunch)
    python bench/sharded.py --device cuda --gpus 2 --placement apart       # trainer on GPU 0, engine on 1: NCCL
    python bench/sharded.py --device cuda --gpus 2 --placement colocated   # rank r on GPU r % 2: both
    python bench/sharded.py --model tiny-moe --layouts tp,ep   # a real MoE (fused experts, per expert on the wire)
    python bench/sharded.py --model tiny-moe --layouts tp,ep --stacked   # ... stacked on the wire (vLLM's, hf's)
    python bench/sharded.py --model tiny-moe --experts 28   # the tiny MoE as many bytes as the dense tiny (0.93 MB)
    python bench/sharded.py --model tiny-moe --experts 28 --against tiny --rounds 7 --trainer-ranks 2 --engine-ranks 2
                                        # ... and the dense tiny, case by case in turn: seconds per byte, MoE / dense
    python bench/sharded.py --model tiny-moe --experts 128 --layers 48 --trainer-ranks 2 --engine-ranks 2
                                        # Qwen3-30B-A3B's count of tensors (18 867, each tiny): the work per tensor
    BENCH_PROFILE=/tmp/prof python bench/sharded.py ...   # each worker writes a cProfile of its timed repeats

On one GPU every trainer rank and engine rank shares the GPU: the receivers pull their boxes over CUDA
IPC (casting fp32 to bf16 on the copy), and the rank-0 path cannot run at all (it gathers among ranks
on one GPU, which NCCL refuses and gloo does not do on CUDA). The limit there is a device copy of the
bytes received, and the same with the cast, timed in the same run. On two GPUs, `apart` puts every
trainer rank on GPU 0 and every engine rank on GPU 1 (every pair over NCCL; the limit is a raw NCCL
transfer of the bytes between the two GPUs, timed in the same run), and `colocated` puts trainer rank r
and engine rank e on GPUs r % 2 and e % 2, as a trainer and an engine sharing two GPUs are laid out
(pairs on one GPU pull, the others go over NCCL; both limits reported).

Per case and path: sync seconds (median of --repeats after a warm-up), the peak extra memory of every
trainer rank against its bound (two buckets plus the largest slice it sends), staging per engine rank
against its shard, bytes received per engine rank over its shard (and, for a mixture of experts, of
them the experts': under `ep` each engine rank loads whole experts, rank r of g the r-th g-th of them,
as vLLM's expert parallelism places them), and where each member's time went: the last repeat's stages
(`profile`) and each stage's median over the repeats (`profile_median`). Offers and answers travel through
the TCPStore the processes share (protobuf bytes), as they would through the coordinator. Last, how
long planning the routes takes at scale (256 trainer ranks into 4 TP=8 replicas, 50 tensors).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import preset_shapes  # noqa: E402
from publish import Peak, build_module  # noqa: E402
from transfer import _timed, d2d_limit, nccl_limit  # noqa: E402

from rlsync.flat import FlatStore  # noqa: E402
from rlsync.publish import WeightMap  # noqa: E402
from rlsync.publish.source import module_source  # noqa: E402
from rlsync.transfer import Receiver, WeightSender, answer  # noqa: E402
from rlsync.transfer.manifest import Spec, from_proto  # noqa: E402
from rlsync.transfer.routes import chunks, whole  # noqa: E402
from rlsync.transfer.handshake import local_facts  # noqa: E402
from rlsync.transfer.held import HELD  # noqa: E402
from rlsync.publish.core import PublisherCore  # noqa: E402
from rlsync.publish.ranks import Ranks  # noqa: E402
from rlsync.transfer.relaunch import relaunch  # noqa: E402
from rlsync.transfer.sender import Report  # noqa: E402
from rlsync.transfer.sharded import RoutedReceiver, to_layout_proto  # noqa: E402
from rlsync.transfer.streams import transfer_stream  # noqa: E402
from rlsync.transfer.source import StreamedSource, run_pass  # noqa: E402
from rlsync.transfer.v1 import transfer_pb2 as pb  # noqa: E402

GB = 1e9


def rank0_source(model, weights: WeightMap) -> StreamedSource:
    """The rank-0 path, kept here as the baseline: every tensor cast on each rank, then its shards
    gathered to rank 0 (dim-0 shards with one plain gather, padded as torch.chunk splits), tensor
    after tensor in a pass every rank walks."""
    from torch.distributed.tensor import DTensor

    tensors = dict(model.named_parameters())
    entries = weights.plan([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])

    def gathered(t):
        t = t.detach().to(torch.bfloat16)
        if not isinstance(t, DTensor):
            return t
        group, world, rows = t.device_mesh.get_group(), t.device_mesh.size(), t.shape[0]
        local, chunk = t.to_local(), -(-rows // world)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[:local.shape[0]] = local
        if dist.get_rank() == 0:
            out = local.new_empty((chunk * world, *local.shape[1:]))
            dist.gather(padded, list(out.chunk(world)), dst=0, group=group)
            return out[:rows]
        dist.gather(padded, None, dst=0, group=group)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    specs = [Spec(e.name, e.dtype, e.shape, math.prod(e.shape) * e.dtype.itemsize) for e in entries]
    return StreamedSource(specs, torch.device("cpu"), lambda i: gathered(tensors[entries[i].parts[0]]))


EXPERT = re.compile(r"\.experts\.(\d+)\.")
STACKED = re.compile(r"\.experts\.[a-z_]+$")  # (--stacked: an experts parameter [E, n, R, ...] under its name)


def engine_boxes(specs, g: int, rank: int, ep: bool = False) -> list[list]:
    """What tensor-parallel rank `rank` of `g` loads: 2-D weights by rows, everything else whole; with `ep`,
    an expert's tensors whole on the rank that owns the expert (rank r: the r-th g-th of the experts). Of a
    stacked experts tensor, the same: every expert's rows (its dim 2), or the rank's run of whole experts."""
    experts = 1 + max((int(m.group(1)) for s in specs if (m := EXPERT.search(s.name))), default=-1)
    out = []
    for s in specs:
        box = whole(s.shape)
        if STACKED.search(s.name) and len(s.shape) == 4:
            owned = [e for e in range(s.shape[0]) if e * g // s.shape[0] == rank]
            if ep:
                box = ((owned[0], owned[-1] + 1), *box[1:]) if owned else ((0, 0), *box[1:])
            elif g > 1:
                box = (*box[:2], chunks(s.shape[2], g)[rank], *box[3:])
            out.append([box] if all(b > a for a, b in box) else [])
            continue
        expert = EXPERT.search(s.name)
        if ep and expert:
            out.append([box] if int(expert.group(1)) * g // experts == rank else [])
            continue
        if len(s.shape) == 2 and g > 1:
            box = (chunks(s.shape[0], g)[rank], box[1])
        out.append([box] if all(b > a for a, b in box) else [])
    return out


def _get(store, key: str, timeout: float = 600) -> bytes:
    store.wait([key], datetime.timedelta(seconds=timeout))
    return store.get(key)


PROFILE = os.environ.get("BENCH_PROFILE")  # a folder: each worker writes a cProfile of its timed repeats there


def _profiled():
    """A profiler a worker turns on for its timed repeats (BENCH_PROFILE), else None."""
    return cProfile.Profile() if PROFILE else None


def _dump(profiler, role: str, path: str, k: int, g: int, rank: int) -> None:
    if profiler is not None:
        profiler.disable()
        os.makedirs(PROFILE, exist_ok=True)
        profiler.dump_stats(os.path.join(PROFILE, f"{role}-{path}-k{k}-g{g}-r{rank}.prof"))


def _median(profiles: list[dict]) -> dict:
    """Each stage's median over the timed repeats (a stage a repeat did not go through counts as 0)."""
    stages = dict.fromkeys(k for p in profiles for k in p)
    return {k: round(statistics.median(p.get(k, 0.0) for p in profiles), 5) for k in stages}


def paths(args) -> tuple[str, ...]:
    """rank0 and routed on CPU; routed on GPUs; with --hold on one GPU, then `armed`: the repeat a replica holding
    every trainer rank's storages makes of an offer that names their memories (Routing.memories): it copies as it
    prepares (the launch it kept, rlsync.transfer.relaunch) and no rank sends."""
    if args.device == "cpu":
        return "rank0", "routed"
    return ("routed", "armed") if args.hold and args.gpus == 1 else ("routed",)


def trainer(args, shapes, bucket, k: int, g: int, rank: int, store) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(args.device).type, (k,))
    if args.model:  # a real model, sharded as rlsync's trainer shards it: one unit per decoder block
        from transformers import AutoModelForCausalLM

        from rlsync.models import resolve_model

        model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).to(args.device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    else:
        model = build_module(shapes, torch.float32, args.device)
    fully_shard(model, mesh=mesh)
    module, _ = module_source(model, WeightMap(dtype=torch.bfloat16), stacked=args.stacked)
    baseline = rank0_source(model, WeightMap(dtype=torch.bfloat16)) if args.device == "cpu" else None
    largest = max(s.nbytes for s in module.specs)
    out = {}
    for path in paths(args):
        dist.barrier()
        peak, seconds, profiler, profiles = Peak(args.device), [], _profiled(), []
        if path != "armed":  # (armed: the routed path's sender, whose storages the engine ranks hold)
            sender = WeightSender(baseline, bucket_bytes=bucket, backends=["gloo"]) if path == "rank0" and rank == 0 \
                else module.sender(bucket_bytes=bucket) if path == "routed" else None
        for i in range(args.repeats + 1):
            dist.barrier()
            if i == 1 and profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            if path == "rank0":
                if rank == 0:
                    offer = sender.offer(version=i)
                    store.set(f"{path}/offer/{i}", offer.SerializeToString())
                    answers = [pb.Answer.FromString(_get(store, f"{path}/answer/{i}/{e}")) for e in range(g)]
                    sender.send(offer, answers, timeout=600)
                else:
                    run_pass(baseline)  # takes part in the gathers
            elif path == "armed":  # every rank says where its storages lie (one all-gather), as an offer's job does
                ranks = Ranks()
                digests = PublisherCore._keep_memory(ranks, sender, PublisherCore._gather_memory(ranks, sender, None))
                described = time.perf_counter()
                if rank == 0:
                    if not digests:
                        raise RuntimeError("a trainer rank could not say where its storages lie: nothing to arm")
                    offer = sender.offer(version=i)
                    offer.routing.memories.extend(digests)
                    offer.routing.holder = "bench"
                    store.set(f"{path}/offer/{i}", offer.SerializeToString())
                profile = {"describe": described - start, "offer": time.perf_counter() - described}
            else:
                if rank == 0:
                    offer = sender.offer(version=i)
                    store.set(f"{path}/offer/{i}", offer.SerializeToString())
                offer = pb.Offer.FromString(_get(store, f"{path}/offer/{i}"))
                answers = [pb.Answer.FromString(_get(store, f"{path}/answer/{i}/{e}")) for e in range(g)]
                report = sender.send(offer, answers[:1], timeout=600)  # the g ranks answer as one replica
                profile = {k: round(v, 4) for k, v in report.profile.items()}
            _get(store, f"{path}/done/{i}")  # every engine rank confirmed
            if i:
                seconds.append(time.perf_counter() - start)
                profiles += [report.profile] if path == "routed" else [profile] if path == "armed" else []
            if path == "armed" and rank == 0:
                sender.settled(offer)
        _dump(profiler, "trainer", path, k, g, rank)
        if sender is not None and not (path == "routed" and "armed" in paths(args)):  # (armed sends with it next)
            sender.close()
        out[path] = {"seconds": statistics.median(seconds), "peak_extra_bytes": peak.extra(),
                     "bound_bytes": 2 * bucket + largest,
                     **({"profile": profile, "profile_median": _median(profiles)} if path != "rank0" else {})}
    return out


def engine(args, k: int, g: int, rank: int, store) -> dict:
    out = {}
    for path in paths(args):
        seconds, staging, profiler, layouts, profiles, boxes = [], None, _profiled(), None, [], None
        for i in range(args.repeats + 1):
            if i == 1 and profiler is not None:
                profiler.enable()
            offer = pb.Offer.FromString(_get(store, f"{path}/offer/{i}"))
            specs = from_proto(offer.manifest)
            if i == 0:  # an engine's layout is its own, the same at every update
                mine = engine_boxes(specs, g, rank, args.layout == "ep")
            if path == "rank0":  # every engine rank receives the whole checkpoint, as before
                staging = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
                ans = answer(offer, f"engine-{rank}", force="gloo")
                store.set(f"{path}/answer/{i}/{rank}", ans.SerializeToString())
                report = Receiver(offer, ans, staging).run()
            else:
                boxes = boxes or {s.name: b[0] for s, b in zip(specs, mine) if b}
                # (as an hf replica stages: one flat store, what receivers lay out over it kept in its memo)
                staging = staging or FlatStore({s.name: (tuple(e - a for a, e in boxes[s.name]), s.dtype)
                                                for s in specs if s.name in boxes}, device=args.device)
                keep = staging.memo
                layouts = layouts or [to_layout_proto(engine_boxes(specs, g, r, args.layout == "ep"),
                                                      local_facts(engine_device(args, r)))
                                      for r in range(g)]  # where each rank runs: pairs on one GPU pull
                ans = answer(offer, "replica", ranks=g, layout=layouts, device=args.device)
                store.set(f"{path}/answer/{i}/{rank}", ans.SerializeToString())
                report = armed(args, offer, ans, staging, rank, boxes, keep) if path == "armed" else \
                    RoutedReceiver(offer, ans, staging, rank=rank, boxes=boxes, device=args.device,
                                   hold="bench" if args.hold else "", keep=keep).run()
            if i:
                seconds.append(report.seconds)
                profiles.append(report.profile)
            done = store.add(f"{path}/count/{i}", 1)
            if done == g:
                store.set(f"{path}/done/{i}", b"1")
        _dump(profiler, "engine", path, k, g, rank)
        shard = sum(t.numel() * t.element_size() for t in getattr(staging, "views", staging).values())
        loads = sum(math.prod(e - a for a, e in b[0]) * s.dtype.itemsize for s, b in zip(specs, mine) if b)
        experts = sum(math.prod(e - a for a, e in b[0]) * s.dtype.itemsize for s, b in zip(specs, mine)
                      if b and (EXPERT.search(s.name) or STACKED.search(s.name)))
        out[path] = {"staging_bytes": shard, "received_bytes": report.nbytes, "shard_bytes": loads,
                     "expert_bytes": experts if path == "routed" else 0,
                     "receive_seconds": statistics.median(seconds), "channels": report.backends,
                     "profile": {k: round(v, 4) for k, v in report.profile.items()},
                     "profile_median": _median(profiles)}
    HELD.release("bench")  # before the trainer's memory goes
    return out


def armed(args, offer: pb.Offer, ans: pb.Answer, staging: FlatStore, rank: int, boxes: dict, keep: dict) -> Report:
    """An engine rank holding every storage it pulls from, as a replica's prepare takes an offer naming the ranks'
    memories: the launch it kept for this staging, queued at once (rlsync.transfer.relaunch); else it arms
    (RoutedReceiver's at_once), which keeps that launch. Its time: from its answer, put, to the bytes in place."""
    start, device = time.perf_counter(), torch.device(args.device)
    stream = transfer_stream(device)
    with torch.cuda.stream(stream):
        relaunched = relaunch(keep, offer.routing, from_proto(offer.manifest), rank)
    if relaunched is None:
        report = RoutedReceiver(offer, ans, staging, rank=rank, boxes=boxes, device=args.device, hold="bench",
                                keep=keep, at_once=True, timeout=30).run()
        if not report.copied:
            raise RuntimeError(f"engine rank {rank} did not copy the offer as it prepared: {report.profile}")
        nbytes, profile = report.nbytes, {"relaunched": 0.0, **report.profile}
    else:
        nbytes, profile = relaunched[0], {"relaunched": 1.0, "launch": time.perf_counter() - start}
    stream.synchronize()
    seconds = time.perf_counter() - start
    return Report(nbytes, seconds, {"cuda_ipc": 1}, profile=profile)


def gpu_of(args, role: str, rank: int) -> int:
    if args.placement == "apart":
        return 0 if role == "trainer" else 1
    return rank % args.gpus


def engine_device(args, rank: int) -> str:
    return f"cuda:{gpu_of(args, 'engine', rank)}" if args.gpus > 1 else args.device


def worker(args) -> None:
    role, k, g, rank = os.environ["ROLE"], int(os.environ["K"]), int(os.environ["G"]), int(os.environ["RANK"])
    if args.gpus > 1:
        args.device = f"cuda:{gpu_of(args, role, rank)}"
        torch.cuda.set_device(args.device)  # before the device mesh, which would pick one itself
    shapes, bucket = preset_shapes(args.preset), args.bucket_mib << 20
    host, port = os.environ["BENCH_STORE"].split(":")
    store = dist.TCPStore(host, int(port), is_master=False)
    if role == "trainer":
        dist.init_process_group("gloo" if args.device == "cpu" else "cpu:gloo,cuda:gloo")
        result = trainer(args, shapes, bucket, k, g, rank, store)
        dist.barrier()  # the trainer ranks leave together, then tear their group down
        dist.destroy_process_group()
    else:
        result = engine(args, k, g, rank, store)
    print("RESULT " + json.dumps({"role": role, "rank": rank, **result}), flush=True)


def run_case(args, k: int, g: int) -> dict:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    store = dist.TCPStore("127.0.0.1", ports[0], is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[1]), "WORLD_SIZE": str(k),
           "OMP_NUM_THREADS": "1", "K": str(k), "G": str(g), "BENCH_STORE": f"127.0.0.1:{ports[0]}"}
    cmd = [sys.executable, __file__, "--worker", "--preset", args.preset, "--bucket-mib", str(args.bucket_mib),
           "--model", args.model, "--layout", args.layout,
           "--repeats", str(args.repeats), "--device", args.device, "--gpus", str(args.gpus),
           "--placement", args.placement, *(["--hold"] if args.hold else []), *(["--stacked"] if args.stacked else [])]
    procs = [subprocess.Popen(cmd, env={**env, "ROLE": role, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for role, n in (("trainer", k), ("engine", g)) for r in range(n)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    del store
    results = []
    for p, out in zip(procs, outs):
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None or p.returncode:
            raise RuntimeError(f"a process failed: {[p.returncode for p in procs]}")
        results.append(json.loads(line[len("RESULT "):]))
    trainers = [r for r in results if r["role"] == "trainer"]
    engines = [r for r in results if r["role"] == "engine"]
    case = {"trainer_ranks": k, "engine_ranks": g, "layout": args.layout, "stacked": args.stacked}
    for path in paths(args):
        case[path] = {
            "seconds": round(trainers[0][path]["seconds"], 4),
            "peak_extra_bytes": [t[path]["peak_extra_bytes"] for t in trainers],
            "bound_bytes": trainers[0][path]["bound_bytes"],
            "within_bound": all(t[path]["peak_extra_bytes"] <= t[path]["bound_bytes"] for t in trainers),
            "staging_bytes": [e[path]["staging_bytes"] for e in engines],
            "received_bytes": [e[path]["received_bytes"] for e in engines],
            "received_over_shard": [round(e[path]["received_bytes"] / e[path]["shard_bytes"], 3) for e in engines],
            "receive_seconds": [round(e[path]["receive_seconds"], 4) for e in engines],
            "channels": [e[path]["channels"] for e in engines],
            "profile": [e[path]["profile"] for e in engines],
            "profile_median": [e[path]["profile_median"] for e in engines]}
        if path != "rank0":
            case[path]["trainer_profile"] = [t[path]["profile"] for t in trainers]
            case[path]["trainer_profile_median"] = [t[path]["profile_median"] for t in trainers]
            case[path]["MBps"] = round(sum(e[path]["received_bytes"] for e in engines) / case[path]["seconds"] / 1e6, 1)
            if any(e[path]["expert_bytes"] for e in engines):
                case[path]["expert_bytes"] = [e[path]["expert_bytes"] for e in engines]
    if "rank0" in case:
        case["routed_over_rank0_seconds"] = round(case["routed"]["seconds"] / case["rank0"]["seconds"], 3)
    if args.device != "cpu":  # the limit: a device copy of the bytes every engine rank received, plain and cast
        received = sum(e["routed"]["received_bytes"] for e in engines)
        limits = {}
        if args.gpus == 1 or args.placement == "colocated":
            limits |= {"copy": d2d_limit(received, "cuda:0"), "cast_copy": cast_copy_limit(received, "cuda:0")}
        if args.gpus > 1:
            limits["nccl"] = nccl_limit(received, 2)
        for path in paths(args):  # the sync as the trainer saw it, and (armed) the engine ranks' part alone
            seconds = {"": case[path]["seconds"]}
            if path == "armed":
                seconds["engine_"] = max(case[path]["receive_seconds"])
            for at, took in seconds.items():
                rate = received / took / GB
                case[path][f"{at}GBps"] = round(rate, 2)
                for name, limit in limits.items():
                    case[path] |= {f"{name}_limit_GBps": round(limit, 2),
                                   f"{at}ratio_to_{name}": round(rate / limit, 3)}
    return case


def against(args, k: int, g: int) -> dict:
    """--model and --against, case by case in turn for --rounds (so a host's load falls on both alike): the routed
    sync's seconds per byte received of the one over the other's, per round, and the median."""
    first, rounds = args.model, []
    try:
        for _ in range(args.rounds):
            per_byte = []
            for model in (first, args.against):
                args.model = model
                routed = run_case(args, k, g)["routed"]
                per_byte.append((routed["seconds"], sum(routed["received_bytes"])))
            (a, a_bytes), (b, b_bytes) = per_byte
            rounds.append({"seconds": [a, b], "bytes": [a_bytes, b_bytes],
                           "ratio": round(a / a_bytes / (b / b_bytes), 3)})
    finally:
        args.model = first
    return {"trainer_ranks": k, "engine_ranks": g, "layout": args.layout, "rounds": rounds,
            "ratio_median": statistics.median(r["ratio"] for r in rounds),
            "seconds_median": [statistics.median(r["seconds"][i] for r in rounds) for i in (0, 1)]}


def cast_copy_limit(nbytes: int, device: str) -> float:
    """GB/s (of bf16 written) of casting fp32 values into bf16 on the device: what a pull of the
    trainer's fp32 masters into the engine's bf16 does."""
    src = torch.ones(nbytes // 2, dtype=torch.float32, device=device)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize(device)

    return nbytes / _timed(copy, 5) / GB


def plan_seconds(k: int = 256, replicas: int = 4, tp: int = 8, tensors: int = 50, n: int = 4096) -> dict:
    """How long planning takes at scale: k row shards of `tensors` n x n tensors into `replicas`
    tensor-parallel replicas of `tp` ranks that split columns (every cell its own piece)."""
    from rlsync.transfer.routes import TensorInfo, layout, plan_routes

    infos = [TensorInfo(f"t{i}", (n, n), 2) for i in range(tensors)]
    trainer = layout(infos, [[[(chunks(n, k)[r], (0, n))] for _ in infos] for r in range(k)])
    engine = layout(infos, [[[((0, n), chunks(n, tp)[e % tp])] for _ in infos] for e in range(replicas * tp)])
    start = time.perf_counter()
    routes = plan_routes(trainer, engine)
    return {"trainer_ranks": k, "replicas": replicas, "tp": tp, "tensors": tensors, "shape": [n, n],
            "transfers": len(routes.transfers), "seconds": round(time.perf_counter() - start, 3)}


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # freed blocks go back to the OS: RSS shows what is held
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--model", default="", help="a real model instead of a preset's shapes: tiny, tiny-moe, a path")
    parser.add_argument("--experts", type=int, default=0, help="with --model tiny-moe: this many experts (28: as many "
                        "bytes as --model tiny, so that the two compare per byte with their fixed costs alike)")
    parser.add_argument("--layers", type=int, default=0, help="with --model tiny-moe: this many layers (48 layers of "
                        "128 experts: Qwen3-30B-A3B's 18 867 tensors, each tiny)")
    parser.add_argument("--layouts", default="tp", help="engine layouts to run, comma-separated: tp, ep (experts "
                        "whole on the rank that owns them)")
    parser.add_argument("--layout", default="tp", help=argparse.SUPPRESS)
    parser.add_argument("--stacked", action="store_true", help="a mixture of experts' fused parameters sent stacked "
                        "(one tensor per layer and projection, as to replicas that take them so), not per expert")
    parser.add_argument("--bucket-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-ranks", default="1,2,4")
    parser.add_argument("--engine-ranks", default="1,2")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every process on one GPU")
    parser.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="with --device cuda")
    parser.add_argument("--placement", default="apart", choices=("apart", "colocated"), help="with --gpus 2")
    parser.add_argument("--hold", action="store_true", help="engine ranks keep the trainer's storages mapped "
                        "across repeats (RoutedReceiver's hold), as ranks whose trainer stays on the GPU may")
    parser.add_argument("--against", default="", help="a second model (tiny) run case by case in turn with --model: "
                        "the routed sync's seconds per byte of --model over this one's, per round and their median")
    parser.add_argument("--rounds", type=int, default=1, help="with --against: how many turns of each")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.experts or args.layers:
        from rlsync.models import TinyMoeRecipe, ensure_tiny_moe

        shape = {"num_experts": args.experts or TinyMoeRecipe.num_experts,
                 "num_hidden_layers": args.layers or TinyMoeRecipe.num_hidden_layers}
        args.model = str(ensure_tiny_moe(TinyMoeRecipe(**shape)))
    cases, compared = [], []
    for layout in args.layouts.split(","):
        args.layout = layout
        for k in map(int, args.trainer_ranks.split(",")):
            for g in map(int, args.engine_ranks.split(",")):
                if args.against:
                    compared.append(against(args, k, g))
                    print(json.dumps(compared[-1]), flush=True)
                    continue
                case = run_case(args, k, g)
                print(json.dumps(case), flush=True)
                cases.append(case)
    if compared:
        print(json.dumps({"model": args.model, "against": args.against, "device": args.device, "compared": compared}))
        return
    plan = plan_seconds()
    print(json.dumps({"plan": plan}), flush=True)
    device = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    if args.gpus > 1:
        device = f"{device} x{args.gpus} ({args.placement})"
    print(json.dumps({"preset": args.preset, "model": args.model, "device": device,
                      "bucket_bytes": args.bucket_mib << 20, "hold": args.hold, "cases": cases, "plan": plan}))


if __name__ == "__main__":
    main()
